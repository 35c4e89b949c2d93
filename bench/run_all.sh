#!/usr/bin/env bash
# `make bench`: every CPU benchmark in turn; each prints its table and writes JSON to bench/results/.
# The GPU check is separate (bench/gpu_check.sh, on a machine with one H200). Pass names to run a subset:
#   bench/run_all.sh engine_throughput speculative
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ALL=(engine_throughput cpu_forward cpu_bf16 gemv_cpu simd_ab amx_ab cpu_dram model_quality quant_cpu quant_quality speculative spec_policy spec_replay router_latency routing
     slo_policy_overhead gateway_overhead loadgen_capacity slo)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=("${ALL[@]}")
for name in "${names[@]}"; do
  echo "== bench/$name.py"
  "$PY" "bench/$name.py"
done
if [ $# -eq 0 ]; then
  echo "== bench/compare_strategies.sh"
  bash bench/compare_strategies.sh
fi
