"""Speculative decoding: a small model drafts k tokens per sequence, the engine's model verifies them in one
pass over k + 1 positions, and rejection sampling keeps the target's output distribution exactly.

`decoder` (propose / rollback, metrics), `drafter` (draft KV in the shared pool), `verify` (pure: logits ->
accepted tokens), `rejection` (the rejection sampler's fast paths), `adaptive` (k), `windows` (drafting
windows looped in one step), `lean_runner` (the CPU draft runner where the C forward does not cover the draft:
bf16 weights, no C compiler), `state` (a sequence's draft state)."""
