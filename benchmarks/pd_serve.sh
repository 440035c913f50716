#!/usr/bin/env bash
# Issue #19's benchmark: decode TPOT under prompt-heavy load, prefill/decode disaggregated against colocated.
#
#   pd:   a prefill `runtime serve` on GPU 0 and a decode one on GPU 1 (each sees the other second, as the
#         CudaIpcConnector needs), KV blocks pulled GPU to GPU, behind `runtime proxy`;
#   colo: one `runtime serve -dp 2` over both GPUs.
#
# Loads (`runtime bench serve --dataset-name random-ids`, p50 and p99): a warm-up of 8 requests of 4,000 prompt
# tokens (not reported); base: 48 requests of 32 + 200 tokens at concurrency 8 (no prefill to speak of); long:
# 16 requests of 4,000 + 200 at concurrency 4 (the load's context lengths, decoding at about its batch); rateN:
# N x SECONDS_PER_RATE requests of 4,000 + 200 tokens arriving at N a second (Poisson). The target: p99 TPOT
# under load at most 1.3x the TPOT with no prefill running (base / long p50).
#
#   MODES="pd colo" RATES="2 4 8" SECONDS_PER_RATE=20 bash benchmarks/pd_serve.sh [model]
#
# Default model: the 8B shape with dummy weights. CONNECTOR=TcpConnector PLATFORM=cpu runs the same flow on a
# machine without GPUs (a tiny model, small lengths through INPUT_LEN / OUTPUT_LEN / MAX_MODEL_LEN / EXTRA).
# Logs and one JSON per run go to ${OUT:-pd-results}; a table is printed last.
set -euo pipefail

MODEL=${1:-benchmarks/configs/llama-3.1-8b}
OUT=${OUT:-pd-results}
MODES=${MODES:-pd colo}
RATES=${RATES:-2 4 8}
SECONDS_PER_RATE=${SECONDS_PER_RATE:-20}
CONNECTOR=${CONNECTOR:-CudaIpcConnector}
PLATFORM=${PLATFORM:-cuda}
INPUT_LEN=${INPUT_LEN:-4000}
OUTPUT_LEN=${OUTPUT_LEN:-200}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4608}
EXTRA=${EXTRA:---load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.85 --max-num-seqs 128}
PORT=${PORT:-8000}
mkdir -p "$OUT"
COMMON="--platform $PLATFORM --skip-tokenizer-init --max-model-len $MAX_MODEL_LEN --async-scheduling $EXTRA"
PIDS=()

stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

start() {  # log, env assignments..., -- command...
  local log=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" "$@" > "$log" 2>&1 &
  PIDS+=($!)
}

wait_ready() {  # url, log: until the server answers /health; fails if any started process exits first
  for _ in $(seq 1 600); do
    if curl -sf "$1/health" > /dev/null; then return 0; fi
    for pid in "${PIDS[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then echo "a process exited before $1 was ready; see $2" >&2; tail -20 "$2" >&2; return 1; fi
    done
    sleep 1
  done
  echo "$1 did not become ready in 600 s; see $2" >&2
  return 1
}

transfer() {  # role, port
  printf '{"kv_connector": "%s", "kv_role": "%s", "kv_port": %d}' "$CONNECTOR" "$1" "$2"
}

bench() {  # mode, load name, url, bench flags...
  local mode=$1 load=$2 url=$3; shift 3
  runtime bench serve --base-url "$url" --dataset-name random-ids --metric-percentiles 50,99 --save-result \
    --result-filename "$OUT/$mode-$load.json" "$@" > "$OUT/$mode-$load.log" 2>&1
}

run_loads() {  # mode, url
  local mode=$1 url=$2
  bench "$mode" warmup "$url" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts 8 --max-concurrency 4
  bench "$mode" base "$url" --input-len 32 --output-len "$OUTPUT_LEN" --num-prompts 48 --max-concurrency 8
  bench "$mode" long "$url" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts 16 --max-concurrency 4
  for rate in $RATES; do
    bench "$mode" "rate$rate" "$url" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --num-prompts $((rate * SECONDS_PER_RATE)) --request-rate "$rate"
  done
}

for mode in $MODES; do
  url="http://127.0.0.1:$PORT"
  if [ "$mode" = pd ]; then
    # shellcheck disable=SC2086  # COMMON holds several flags
    start "$OUT/pd-prefill.log" CUDA_VISIBLE_DEVICES=0,1 -- runtime serve "$MODEL" --port $((PORT + 1)) $COMMON \
      --kv-transfer-config "$(transfer kv_producer $((PORT + 11)))"
    wait_ready "http://127.0.0.1:$((PORT + 1))" "$OUT/pd-prefill.log"
    # shellcheck disable=SC2086
    start "$OUT/pd-decode.log" CUDA_VISIBLE_DEVICES=1,0 -- runtime serve "$MODEL" --port $((PORT + 2)) $COMMON \
      --kv-transfer-config "$(transfer kv_consumer $((PORT + 12)))"
    wait_ready "http://127.0.0.1:$((PORT + 2))" "$OUT/pd-decode.log"
    start "$OUT/pd-proxy.log" -- runtime proxy --port "$PORT" --prefill "http://127.0.0.1:$((PORT + 1))" \
      --decode "http://127.0.0.1:$((PORT + 2))"
    wait_ready "$url" "$OUT/pd-proxy.log"
  elif [ "$mode" = colo ]; then
    # shellcheck disable=SC2086
    start "$OUT/colo-server.log" CUDA_VISIBLE_DEVICES=0,1 -- runtime serve "$MODEL" --port "$PORT" -dp 2 $COMMON
    wait_ready "$url" "$OUT/colo-server.log"
  else
    echo "unknown mode $mode; valid: pd colo" >&2
    exit 2
  fi
  run_loads "$mode" "$url"
  stop_all
done

python3 - "$OUT" $MODES <<'PY'
import json, os, sys

out, modes = sys.argv[1], sys.argv[2:]
print("| mode | load | TPOT p50 | TPOT p99 | p99 / base p50 | p99 / long p50 | TTFT p50 | TTFT p99 | output tok/s | failed |")
print("|---|---|---|---|---|---|---|---|---|---|")
for mode in modes:
    runs = sorted(f[len(mode) + 1:-5] for f in os.listdir(out) if f.startswith(mode + "-") and f.endswith(".json"))
    results = {name: json.load(open(os.path.join(out, f"{mode}-{name}.json"))) for name in runs}
    order = [n for n in ("base", "long") if n in results] + sorted(
        (n for n in results if n.startswith("rate")), key=lambda n: float(n[4:]))
    for name in order:
        r = results[name]
        ratios = [r["p99_tpot_ms"] / results[b]["p50_tpot_ms"] if b in results and results[b]["p50_tpot_ms"] else float("nan")
                  for b in ("base", "long")]
        print(f"| {mode} | {name} | {r['p50_tpot_ms']:.2f} | {r['p99_tpot_ms']:.2f} | {ratios[0]:.2f}x | {ratios[1]:.2f}x "
              f"| {r['p50_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | {r['output_throughput']:,.1f} | {r['failed']} |")
PY
