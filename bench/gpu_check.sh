#!/usr/bin/env bash
# One single-GPU run (H200; under 8 minutes: 210 s of kernel tests at most, 90 s of engine tests, the rest up
# to 450 s for the benchmark): the kernel tests natively (bf16 and fp8 paths included), the engine's
# CUDA-graph test, then bench/gpu_kernels.py (copy bandwidth; paged attention and int8/int4 matmuls with
# triton.testing.do_bench; decode tokens/s at batch 1 and 64 of a random-weight Llama-3-8B-shaped model in
# bf16/int8/int4 vs the roofline). Prints one table and writes one results JSON, bench/results/gpu_check.json
# (each test selection's exit code and summary, the benchmark's rows, machine / commit / date; copied to $OUT
# when set).
#
#   bash bench/gpu_check.sh [gpu_kernels.py options]   # PYTHON=python3 by default
#   bash bench/gpu_check.sh --collect-only              # no GPU needed: collect the selections, run nothing
#
# The CPU suite runs the --collect-only form (tests/bench/test_gpu_check.py), so a moved or renamed test
# breaks `make test`, not the GPU run.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# the pytest selections, each one line: a name, then pytest arguments
SELECTIONS=(
  "kernels tests/kernels/test_kernels_attention.py tests/kernels/test_kernels_kv_write.py tests/kernels/test_kernels_quant.py tests/kernels/test_kernels_fused.py tests/kernels/test_kernels_model.py tests/kernels/test_int8_groups.py tests/kernels/test_int4_zero_points.py"
  "cuda_graphs tests/engines/test_engine_quant.py -k cuda_graph"
)
declare -A LIMIT_S=([kernels]=210 [cuda_graphs]=90)
PYTEST=(-m pytest -q -p no:cacheprovider -o addopts="" -rs)

if [ "${1:-}" = "--collect-only" ]; then
  rc=0
  for sel in "${SELECTIONS[@]}"; do
    read -r -a words <<< "$sel"
    out=$($PY "${PYTEST[@]}" --collect-only "${words[@]:1}" 2>&1)
    sel_rc=$?
    n=$(grep -c "::" <<< "$out")
    echo "${words[0]}: rc=$sel_rc, $n tests collected"
    grep "::" <<< "$out"
    if [ "$sel_rc" -ne 0 ] || [ "$n" -eq 0 ]; then echo "$out" | tail -20; rc=1; fi
  done
  exit $rc
fi

# compiled kernels on CUDA: with TRITON_INTERPRET=1 at import, triton's own helpers would be interpreted
export TRITON_INTERPRET=0
start=$(date +%s)
tmp=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

for sel in "${SELECTIONS[@]}"; do
  read -r -a words <<< "$sel"
  name=${words[0]}
  echo "== tests: $name (native CUDA, at most ${LIMIT_S[$name]} s) =="
  timeout "${LIMIT_S[$name]}" $PY "${PYTEST[@]}" "${words[@]:1}" > "$tmp/$name.log" 2>&1
  echo $? > "$tmp/$name.rc"
  tail -30 "$tmp/$name.log"
  echo "$name exit code: $(cat "$tmp/$name.rc")  ($(( $(date +%s) - start )) s so far)"
done

echo "== kernel and decode benchmark =="
left=$(( 450 - ($(date +%s) - start) ))
(( left < 60 )) && left=60
timeout "$left" $PY bench/gpu_kernels.py --out "$tmp/gpu_kernels.json" "$@"
echo $? > "$tmp/bench.rc"
total=$(( $(date +%s) - start ))

$PY - "$tmp" "$total" <<'EOF'
import json, sys
from pathlib import Path

from bench.results_meta import write_results

tmp, total = Path(sys.argv[1]), int(sys.argv[2])
tests = {}
for rc_file in sorted(tmp.glob("*.rc")):
    if rc_file.stem == "bench":
        continue
    lines = [l for l in (tmp / f"{rc_file.stem}.log").read_text().splitlines() if l.strip()]
    tests[rc_file.stem] = {"rc": int(rc_file.read_text()), "summary": lines[-1] if lines else ""}
bench = tmp / "gpu_kernels.json"
out = write_results(Path("bench/results/gpu_check.json"), {
    "bench": "gpu_check", "total_s": total, "tests": tests, "benchmark_rc": int((tmp / "bench.rc").read_text()),
    "benchmark": json.loads(bench.read_text()) if bench.is_file() else None})
print(f"wrote {out}")
EOF
if [ -n "${OUT:-}" ]; then cp bench/results/gpu_check.json "$OUT/"; fi
status=0
for f in "$tmp"/*.rc; do [ "$(cat "$f")" = 0 ] || status=1; done
echo "exit codes: $(for f in "$tmp"/*.rc; do printf '%s=%s ' "$(basename "$f" .rc)" "$(cat "$f")"; done)total ${total} s"
rm -rf "$tmp"
exit $status
