#!/usr/bin/env bash
# One server, several `bench serve` runs against it, then the server's gauges, then the server stopped.
#
#   benchmarks/serve_runs.sh "SERVER FLAGS" "BENCH FLAGS" ["BENCH FLAGS" ...]
#
# e.g. benchmarks/serve_runs.sh "flint --load-format dummy --weight-format nvfp4 --max-model-len 4096" \
#          "--endpoint /v1/completions --dataset-name random --random-token-ids --ignore-eos \
#           --random-input-len 1024 --random-output-len 256 --num-prompts 192 --max-concurrency 64"
#
# SERVE_SET="module.ATTR=value,..." starts the server with those module constants set first
# (benchmarks/with_constants.py), so that two settings can be compared on one machine.
#
# The server's log goes to ${SERVE_LOG:-/tmp/flint-serve.log}; after each run the script prints the
# lines of /metrics that say what is still running or waiting and how full the KV cache is (all should
# be back to 0), the prefix cache's counters, the server's mean time to first token and queue time,
# the GPU's busy time and its idle time between steps during the run (/metrics' flint:gpu_*_seconds,
# the CUDA executor's), and how many garbage-collector pauses of 50 ms or more its log reports.
set -euo pipefail
port=${PORT:-8000}
# The CLI: the installed `flint-sched`, or the module where the package is only on PYTHONPATH
# (the GPU machine installs wheels with --target, which writes no console scripts)
if command -v flint-sched >/dev/null; then cli=(flint-sched); else cli=(python3 -m flint_sched.cli); fi
log=${SERVE_LOG:-/tmp/flint-serve.log}
server_flags=$1
shift

server_cli=("${cli[@]}")
if [ -n "${SERVE_SET:-}" ]; then server_cli=(python3 "$(dirname "$0")/with_constants.py" "$SERVE_SET"); fi
# shellcheck disable=SC2086
"${server_cli[@]}" serve $server_flags --port "$port" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT

start=$(date +%s)
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    if ! kill -0 $server 2>/dev/null; then
        echo "server exited during start-up:"; tail -30 "$log"; exit 1
    fi
    sleep 1
done
echo "== server ready in $(( $(date +%s) - start )) s: flint-sched serve $server_flags${SERVE_SET:+ (SERVE_SET=$SERVE_SET)}"
grep -i "kv\|tokens of\|warm" "$log" | tail -5 || true

gpu_seconds() {  # "busy prompt-busy idle stalled" GPU seconds so far (CUDA executor with async scheduling; else zeros)
    awk '/^flint:gpu_busy_seconds_total/ {b = $2} /^flint:gpu_prompt_busy_seconds_total/ {p = $2}
         /^flint:gpu_idle_seconds_total/ {i = $2} /^flint:gpu_stalled_seconds_total/ {s = $2}
         END {print b + 0, p + 0, i + 0, s + 0}' <<<"$1"
}

for bench_flags in "$@"; do
    echo "== flint-sched bench serve $bench_flags"
    read -r busy0 prompt0 idle0 stalled0 < <(gpu_seconds "$(curl -s "http://127.0.0.1:$port/metrics")")
    # shellcheck disable=SC2086
    "${cli[@]}" bench serve --base-url "http://127.0.0.1:$port" --disable-tqdm $bench_flags
    metrics=$(curl -s "http://127.0.0.1:$port/metrics")
    read -r busy1 prompt1 idle1 stalled1 < <(gpu_seconds "$metrics")
    awk -v b="$busy1" -v b0="$busy0" -v p="$prompt1" -v p0="$prompt0" -v i="$idle1" -v i0="$idle0" \
        -v s="$stalled1" -v s0="$stalled0" 'BEGIN {
        if (b - b0 + i - i0 > 0)
            printf "GPU during the run: busy %.2f s (steps with prompt rows %.2f s), idle between steps %.2f s (%.1f %%), stalled %.2f s\n",
                   b - b0, p - p0, i - i0, 100 * (i - i0) / (b - b0 + i - i0), s - s0 }'
    grep -E "^flint:(num_requests_running|num_requests_waiting|kv_cache_usage_perc|ring_slot_usage_perc|prefix_cache_(queries|hits)_total|num_preemptions_total)" \
        <<<"$metrics" || true
    # the server's own means so far (all runs of this server): time to first token, and of it the queue
    awk '/^flint:(time_to_first_token|request_queue_time)_seconds_(sum|count)/ {
            name = $1; sub(/\{.*/, "", name); split(name, a, "_seconds_"); v[a[1] "," a[2]] = $2 }
         END { for (m in v) { split(m, k, ","); if (k[2] == "sum" && v[k[1] ",count"] > 0)
                 printf "%s mean (server): %.1f ms\n", k[1], 1000 * v[m] / v[k[1] ",count"] } }' <<<"$metrics"
    # garbage-collector pauses of 50 ms or more so far (api/gc_pauses.py logs each)
    echo "long GC pauses (server log): $(grep -c "garbage collector paused" "$log" || true)"
    grep "garbage collector paused" "$log" | tail -5 || true
done
