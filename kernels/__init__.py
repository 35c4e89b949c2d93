"""tandem kernels: Triton kernels with a PyTorch reference of the same signature beside each one.

paged_attention (prefill / chunked prefill / decode / verify over the paged KV pool), kv_write (slot scatter
+ RoPE + int8/fp8 quantisation), quant_matmul (weight-only int8/int4, QuantLinear, quantize_model), fused
(RMSNorm + residual, SiLU-mul, rejection sampler); engines/attention.py holds the attention contexts over them.
Imports nothing of the project; Triton kernels run compiled on CUDA tensors, interpreted on CPU tensors.
"""
