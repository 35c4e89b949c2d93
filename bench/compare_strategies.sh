#!/usr/bin/env bash
# Compare serving strategies on one workload: large-only (best), small-only (fast), router (auto), cascade,
# and for the large model speculation off, prefix caching off and a w8a8 draft-only copy of the small model. One fresh `tandem serve` per variant and
# rate (a warm prefix cache from the previous run would flatter the next one), the same prompts everywhere
# (fixed --seed and --prompt-seed), one table at the end (docs/benchmark_log.md, "Strategies compared").
#
# The prefix-caching knob is also run on a workload with shared prefixes (long_context_multiturn, variants
# *_mt), because chat prompts share none and the knob cannot show there.
#
#   bench/compare_strategies.sh                 # ~9-10 minutes on 2 shared CPU cores
#   RATES="4" DURATION=20 bench/compare_strategies.sh
#
# Environment: TANDEM_VENV (default .venv), RATES (default "4 12" req/s), DURATION (s of arrivals, 25),
# WARMUP (4), COOLDOWN (2), SEED (0), PROMPT_SEED (1234), PRICE_PER_HOUR (USD per device-hour, 0.10),
# SLO (one SLO for every route of every variant, server admission and client alike, "ttft=1000,tpot=100"),
# WORKLOAD (chat), PREFIX_WORKLOAD (long_context_multiturn, "" for none) and PREFIX_RATE (first of RATES),
# RUNS_DIR (runs/compare_strategies), VARIANTS (space-separated subset of the names below), TABLE_ALL (see below).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${TANDEM_VENV:-.venv}
TANDEM="$VENV/bin/tandem"
PY="$VENV/bin/python"
RATES=${RATES:-"4 12"}
DURATION=${DURATION:-25}
WARMUP=${WARMUP:-4}
COOLDOWN=${COOLDOWN:-2}
SEED=${SEED:-0}
PROMPT_SEED=${PROMPT_SEED:-1234}
PRICE_PER_HOUR=${PRICE_PER_HOUR:-0.10}
SLO=${SLO:-"ttft=1000,tpot=100"}
WORKLOAD=${WORKLOAD:-chat}
PREFIX_WORKLOAD=${PREFIX_WORKLOAD-long_context_multiturn}
PREFIX_RATE=${PREFIX_RATE:-${RATES%% *}}
RUNS_DIR=${RUNS_DIR:-runs/compare_strategies}
OUT_JSON=${OUT_JSON:-bench/results/compare_strategies.json}
IMG_DIR=${IMG_DIR:-docs/img}

# variant:config:route:workload (config = bench/configs/<config>.toml), run at every rate in RATES, then the
# *_mt pair at PREFIX_RATE only. Order = table order.
ALL_VARIANTS="best:baseline:best:$WORKLOAD fast:baseline:fast:$WORKLOAD auto:auto:auto:$WORKLOAD
cascade:baseline:cascade:$WORKLOAD best_nospec:large_nospec:best:$WORKLOAD
best_noprefix:large_noprefix:best:$WORKLOAD best_w8draft:large_w8draft:best:$WORKLOAD"
MT_VARIANTS=""
[[ -n "$PREFIX_WORKLOAD" ]] && MT_VARIANTS="best_mt:baseline:best:$PREFIX_WORKLOAD best_noprefix_mt:large_noprefix:best:$PREFIX_WORKLOAD"
KNOWN="best fast auto cascade best_nospec best_noprefix best_w8draft best_mt best_noprefix_mt"
FULL_VARIANTS=$ALL_VARIANTS
FULL_MT=$MT_VARIANTS
if [[ -n "${VARIANTS:-}" ]]; then
    selected="" selected_mt=""
    for v in $VARIANTS; do
        match=$(tr ' ' '\n' <<<"$ALL_VARIANTS $MT_VARIANTS" | grep "^$v:" || true)
        [[ -n "$match" ]] || { echo "unknown variant $v (known: $KNOWN)" >&2; exit 2; }
        if [[ "$v" == *_mt ]]; then selected_mt+="$match "; else selected+="$match "; fi
    done
    ALL_VARIANTS=$selected MT_VARIANTS=$selected_mt
fi

[[ -x "$TANDEM" ]] || { echo "no $TANDEM (set TANDEM_VENV)" >&2; exit 2; }
"$PY" bench/compare_strategies.py configs --price-per-hour "$PRICE_PER_HOUR" --slo "$SLO" >/dev/null
mkdir -p "$RUNS_DIR"

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID"
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

wait_ready() {  # $1 = url, $2 = server log; up to 90 s (model loading on a busy machine)
    for _ in $(seq 180); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "server exited during start-up; log: $2" >&2; tail -5 "$2" >&2; return 1
        fi
        curl -sf "$1/ready" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    echo "server not ready after 90 s; log: $2" >&2
    return 1
}

PLAN=()
start=$(date +%s)
JOBS=()
for rate in $RATES; do
    for item in $ALL_VARIANTS; do JOBS+=("$item:$rate"); done
done
for item in $MT_VARIANTS; do JOBS+=("$item:$PREFIX_RATE"); done

for job in "${JOBS[@]}"; do
    IFS=: read -r variant config route workload rate <<<"$job"
    PLAN+=("$job")
    out="$RUNS_DIR/${variant}_r${rate}"
    rm -rf "$out" "$out.skipped"
    if [[ "$config" == auto && ! -d models/router ]]; then
        echo "models/router does not exist (the auto route cannot load)" >"$out.skipped"
        echo "== $variant @ $rate req/s: skipped, $(cat "$out.skipped")"
        continue
    fi
    port=$(free_port)
    url="http://127.0.0.1:$port"
    log="$RUNS_DIR/${variant}_r${rate}.serve.log"
    echo "== $variant (config $config, route $route, $workload) @ $rate req/s on $url"
    "$TANDEM" serve --config "bench/configs/$config.toml" --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
    SERVER_PID=$!
    if wait_ready "$url" "$log"; then
        "$TANDEM" loadtest --url "$url" --workload "$workload" --rate "$rate" --duration "$DURATION" \
            --warmup "$WARMUP" --cooldown "$COOLDOWN" --seed "$SEED" --prompt-seed "$PROMPT_SEED" \
            --model "$route" --tokenizer models/tandem-tiny-l --slo "$SLO" \
            --price-per-hour "$PRICE_PER_HOUR" --no-plots --quiet --out "$out" >"$out.loadtest.log" 2>&1 \
            || echo "loadtest failed (exit $?), see $out.loadtest.log" | tee "$out.skipped" >&2
        # the gateway's own view at the end: busy-time cost per 1,000 tokens and SLO attainment per route
        [[ -d "$out" ]] && { curl -sf "$url/v1/routes" >"$out/routes.json" || rm -f "$out/routes.json"; }
    else
        echo "server did not start, see $log" >"$out.skipped"
    fi
    stop_server
done
elapsed=$(( $(date +%s) - start ))

# TABLE_ALL=1: the table covers every variant at every rate with a report in RUNS_DIR, e.g. after
# `VARIANTS=auto TABLE_ALL=1 bench/compare_strategies.sh` adds a late variant to an earlier full run.
if [[ "${TABLE_ALL:-0}" == 1 ]]; then
    PLAN=()
    for rate in $RATES; do
        for item in $FULL_VARIANTS; do PLAN+=("$item:$rate"); done
    done
    for item in $FULL_MT; do PLAN+=("$item:$PREFIX_RATE"); done
fi

meta=$("$PY" - "$elapsed" <<PYEOF
import json, os, platform, subprocess, sys
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
print(json.dumps({
    "command": "bench/compare_strategies.sh",
    "settings": {"rates": "$RATES".split(), "duration_s": $DURATION, "warmup_s": $WARMUP, "cooldown_s": $COOLDOWN,
                 "seed": $SEED, "prompt_seed": $PROMPT_SEED, "price_per_hour_usd": $PRICE_PER_HOUR,
                 "slo": "$SLO", "workload": "$WORKLOAD",
                 "prefix_workload": "$PREFIX_WORKLOAD", "prefix_rate": "$PREFIX_RATE"},
    "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), load average {os.getloadavg()[0]:.1f}",
    "git_commit": git("rev-parse", "HEAD"),
    "models_dirty": git("status", "--porcelain", "models/").splitlines(),
    "elapsed_s": int(sys.argv[1]),
}))
PYEOF
)
"$PY" bench/compare_strategies.py table --runs "$RUNS_DIR" --plan "${PLAN[@]}" --json "$OUT_JSON" \
    --img-dir "$IMG_DIR" --meta "$meta"
echo "wall time ${elapsed}s; JSON: $OUT_JSON; per-run reports: $RUNS_DIR/"
