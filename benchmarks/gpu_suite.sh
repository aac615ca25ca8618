#!/usr/bin/env bash
# The standard GPU measurements in one call (device time is scarce), by part:
#
#   benchmarks/gpu_suite.sh PART [PART ...]
#
#   tests         the GPU tests (tests/gpu; failures and the summary). Their wheels beyond the
#                 project's: ../shared/tools/device-wheels pytest-xdist execnet jsonschema
#                 jsonschema-specifications referencing rpds-py attrs
#   latency       bench latency, NVFP4, bf16 KV: 1K context at 1-256 requests, and 16 at 100K
#   latency-fp8   the same with an e4m3 KV cache: 16 / 64 / 256 at 1K, 16 / 64 at 100K
#   latency-bf16  BF16 weights: 1 / 16 / 64 / 256 at 1K
#   serve         serve_runs.sh, 1K in / 1K out: c=256 with the e4m3 and the bf16 cache, c=64 (bf16)
#   serve-max     c=256 with the flags for throughput: e4m3 cache, 32K-token budget, stream interval 4
#   serve-api     c=256, e4m3, stream interval 1: one process (--api-server-count 0), then the API process (1)
#   persistent    bench_persistent.py: a chain of GEMVs on counters in one launch against launches
#   decode-step   the persistent decode step (kernel_ops.PERSISTENT): its GPU tests, then its
#                 per-operation charges (bench_decode_step.py) and ab_decode at 1 and 4 requests
#                 against the launches (8- and 4-warp CTAs, folded norms, fused Q/K, early weights)
#
# Only the lines that carry figures are printed (decode steps, served throughput, TTFT / ITL, GPU
# busy and idle, failures, what /metrics still holds after a run), after one on the machine (GPU
# clocks and power limit, the host's CPU and its time for a plain Python loop). On a machine with a
# GPU, the wheels in ./.whl (../shared/tools/device-wheels) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n 2,23p "$0"; exit 2; }
if command -v nvidia-smi >/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

latency() {  # weight format, then bench latency's other flags
    local fmt=$1; shift
    python3 -m flint_sched.benchmarks.latency --model flint --weight-format "$fmt" --executor cuda --device cuda \
        --prefill-lens= --num-steps 20 "$@" 2>&1 | grep -E "^decode|^skipped|Error|error" || true
}
serve() {  # server flags after the model's, then bench flags
    local extra=$1; shift
    benchmarks/serve_runs.sh "flint --load-format dummy --weight-format nvfp4 --max-model-len 4096 $extra" "$@" 2>&1 |
        grep -E "$SERVED_FIGURES" || true
}
SERVED_FIGURES="^==|Successful|Failed|Output token throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL"
SERVED_FIGURES+="|GPU during|num_requests|kv_cache_usage|GC|exited|Error"
RANDOM_1K="--endpoint /v1/completions --dataset-name random --random-token-ids --ignore-eos"
RANDOM_1K+=" --random-input-len 1024 --random-output-len 1024"

# Machines of one kind differ (RESULTS.md sessions 25-26: B=1 1.95-2.13 ms, served runs idling the GPU
# 0-23 % between steps): a line on what besides the code decides a run's pace, to compare runs by.
machine() {
    local gpu cpu
    gpu=$(nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader 2>/dev/null)
    cpu=$(grep -m1 "model name" /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ *//')
    python3 - "$gpu" "$cpu" <<'EOF'
import sys, time
start, d = time.perf_counter(), {}
for i in range(1_000_000):
    d[i & 1023] = d.get(i & 4095, 0) + 1
print(f"== machine: {sys.argv[1] or 'no GPU'}; host {sys.argv[2] or '?'}, "
      f"{(time.perf_counter() - start) * 1e3:.0f} ms for a 1M-step Python loop")
EOF
}
machine

for part in "$@"; do
    echo "== gpu_suite $part ($(date -u +%H:%M:%S), $(git rev-parse --short HEAD 2>/dev/null || echo no-git))"
    case $part in
        tests)  # with pytest-xdist, 8 workers: the cold compile takes ~3 min instead of over 10
            workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
            python3 -m pytest -q $workers tests/gpu 2>&1 | grep -E "^FAILED|^ERROR| in [0-9.]+s" ;;
        latency)
            latency nvfp4 --batch-sizes 1,8,9,12,16,32,64,128,256 --contexts 1024
            latency nvfp4 --batch-sizes 16 --contexts 102400 --max-case-seconds 30 ;;
        latency-fp8)
            latency nvfp4 --kv-cache-dtype fp8 --batch-sizes 16,64,256 --contexts 1024
            latency nvfp4 --kv-cache-dtype fp8 --batch-sizes 16,64 --contexts 102400 --max-case-seconds 30 ;;
        latency-bf16) latency bf16 --batch-sizes 1,16,64,256 --contexts 1024 ;;
        serve)
            serve "--kv-cache-dtype fp8" "$RANDOM_1K --num-prompts 512 --max-concurrency 256 --seed 9"
            serve "" "$RANDOM_1K --num-prompts 512 --max-concurrency 256 --seed 9" \
                "$RANDOM_1K --num-prompts 128 --max-concurrency 64 --seed 7" ;;
        serve-max)
            serve "--kv-cache-dtype fp8 --max-num-batched-tokens 32768 --stream-interval 4" \
                "$RANDOM_1K --num-prompts 512 --max-concurrency 256 --seed 9" ;;
        serve-api)
            for count in 0 1; do
                serve "--kv-cache-dtype fp8 --api-server-count $count" "$RANDOM_1K --num-prompts 512 --max-concurrency 256 --seed 9"
            done ;;
        persistent) python3 benchmarks/bench_persistent.py 2>&1 | grep -E "^\||^NVFP4|rror" ;;
        decode-step)
            timeout 300 python3 -m pytest -q -x tests/gpu/test_persistent_step.py tests/gpu/test_cuda_executor.py -k persistent 2>&1 |
                grep -E "^FAILED|^ERROR|Error| in [0-9.]+s"
            python3 benchmarks/bench_decode_step.py --weight-format nvfp4 --batch-sizes 1 --contexts 1024 \
                --variants 8,8-early,8-s66,4-early,8-fold-fuse-early 2>&1 | grep -vE "^making"
            P=flint_sched.executor.kernel_ops.PERSISTENT=True D=flint_sched.kernels.decode_step
            for fmt in nvfp4 bf16; do
                python3 benchmarks/ab_decode.py --weight-format $fmt --batch-sizes 1,4 --contexts 1024 --num-steps 20 \
                    --rounds 2 --variant launches: --variant "persistent:$P" --variant "pearly:$P,$D.EARLY_WEIGHTS=True" \
                    --variant "p4early:$P,$D.WARPS=4,$D.EARLY_WEIGHTS=True" \
                    --variant "pfused:$P,$D.FOLD_NORMS=True,$D.FUSE_QK=True,$D.EARLY_WEIGHTS=True" \
                    2>&1 | grep -E "^\||rror"
            done ;;
        *) echo "unknown part $part (tests, latency, latency-fp8, latency-bf16, serve, serve-max, serve-api, persistent, decode-step)"; exit 2 ;;
    esac
done
