#!/usr/bin/env bash
# One single-H200 run (at most ~8 minutes): the kernel tests natively (bf16 and fp8 paths included), the
# engine's CUDA-graph test (tests/test_engine_quant.py -k cuda_graph), then
# bench/gpu_kernels.py (copy bandwidth; paged attention and int8/int4 matmuls with triton.testing.do_bench;
# decode tokens/s at batch 1 and 64 of a random-weight Llama-3-8B-shaped model in bf16/int8/int4 vs the
# roofline). Prints one table; JSON lands in bench/results/gpu_kernels.json (and $OUT when set).
#
#   bash bench/gpu_check.sh            # PYTHON=python3 by default
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# compiled kernels on CUDA: with TRITON_INTERPRET=1 at import, triton's own helpers would be interpreted
export TRITON_INTERPRET=0
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

echo "== kernel tests (native CUDA) =="
tests_rc=0
if $PY -c "import pytest" 2>/dev/null; then
    # --noconftest: the suite's conftest builds HF checkpoints (transformers), which the kernel tests never use
    timeout 240 $PY -m pytest -q --noconftest -p no:cacheprovider -o addopts="" -rs \
        tests/test_kernels_attention.py tests/test_kernels_kv_write.py tests/test_kernels_quant.py \
        tests/test_kernels_fused.py tests/test_kernels_model.py 2>&1 | tail -40
    tests_rc=${PIPESTATUS[0]}
else
    echo "pytest is not installed here: kernel tests skipped"; tests_rc=99
fi
echo "kernel tests exit code: $tests_rc  ($(( $(date +%s) - start )) s so far)"

echo "== engine on CUDA: decode CUDA graphs replay = eager greedy tokens (float; int8 weights + int8 KV) =="
graphs_rc=99
if $PY -c "import pytest" 2>/dev/null; then
    timeout 150 $PY -m pytest -q --noconftest -p no:cacheprovider -o addopts="" -rs \
        tests/test_engine_quant.py -k cuda_graph 2>&1 | tail -20
    graphs_rc=${PIPESTATUS[0]}
fi
echo "engine graph tests exit code: $graphs_rc  ($(( $(date +%s) - start )) s so far)"

echo "== kernel and decode benchmark =="
left=$(( 470 - ($(date +%s) - start) ))
(( left < 120 )) && left=120
timeout "$left" $PY bench/gpu_kernels.py "$@"
bench_rc=$?
if [ -n "${OUT:-}" ] && [ -f bench/results/gpu_kernels.json ]; then cp bench/results/gpu_kernels.json "$OUT/"; fi
echo "kernel tests rc=$tests_rc, engine graph tests rc=$graphs_rc, benchmark rc=$bench_rc, total $(( $(date +%s) - start )) s"
exit $(( tests_rc != 0 || graphs_rc != 0 || bench_rc != 0 ))
