#!/usr/bin/env bash
# The GPU targets of issues #14 (8-bit), #16 (TP=2) and #18 (4-bit), each beside its bf16 peer in the same
# run, with a table of figure against target last. The targets are for H200s; on another card the table
# still prints (compare each figure with its peer, not with the target).
#
#   bash benchmarks/targets.sh [w3] [w2] [attention] [tp2]     (default: w3 attention; w2 takes ~5 minutes)
#
# w3: batch-1 latency, 128 + 512 tokens: FP8 weights (<= 2.3 ms), 4-bit GPTQ weights (<= 1.5 ms), bf16.
# w2: 1,000 x (1,000 + 1,000) tokens: FP8 weights and cache (>= 18,000 output tok/s), bf16. Each at the
#     running batch that suits its cache: FP8 512 requests and 16,384 tokens a step (its cache, 1.79 M tokens, holds 512 x 2,000
#     with room; 1,024 runs out of blocks and preempts, session 29), bf16 256 (512 would not fit).
# attention: one layer of W2's decode attention, 256 x 1,500 keys, bf16 and FP8 caches (FP8 >= 3.5 TB/s).
# tp2 (two GPUs): W3 at tensor-parallel size 2, bf16 (<= 2.4 ms) and 4-bit.
# Dummy weights of the Llama-3.1-8B shape (benchmarks/configs/llama-3.1-8b); logs under ${OUT:-target-results}.
# Needs the project, hardware/cuda, kernels and plugins/quant installed on the GPU machine.
set -uo pipefail

PARTS=${*:-w3 attention}
OUT=${OUT:-target-results}
mkdir -p "$OUT"
MODEL=benchmarks/configs/llama-3.1-8b
GPTQ="$OUT/llama-3.1-8b-gptq4"  # the same config with a 4-bit GPTQ quantization_config (group 128, symmetric)
mkdir -p "$GPTQ"
python3 - "$MODEL" "$GPTQ" <<'PY'
import json, sys

config = json.load(open(f"{sys.argv[1]}/config.json"))
config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
json.dump(config, open(f"{sys.argv[2]}/config.json", "w"), indent=1)
PY
LAT="runtime bench latency --load-format dummy --dtype bfloat16 --skip-tokenizer-init --input-len 128 --output-len 512
  --batch-size 1 --num-iters 3 --platform cuda --max-model-len 4096 --async-scheduling --backends runtime"
W2="runtime bench throughput --model $MODEL --load-format dummy --dtype bfloat16 --skip-tokenizer-init --num-prompts 1000
  --input-len 1000,1000 --output-len 1000,1000 --platform cuda --max-num-seqs 256 --max-model-len 2048
  --async-scheduling --backends runtime"
ROWS=()
# $LAT and $W2 are left unquoted below on purpose: each holds a command of several words.

run() {  # name, command words...: the output to $OUT/name.log; its result line echoed
  local name=$1; shift
  echo "=== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1 || echo "$name failed (exit $?); see $OUT/$name.log"
  grep "^runtime " "$OUT/$name.log"
}
tpot() { awk '$1 == "runtime" {print $4}' "$OUT/$1.log" | tail -1; }  # the latency table's TPOT ms
tok_s() { awk '$1 == "runtime" {print $NF}' "$OUT/$1.log" | tail -1; }  # the throughput table's output tok/s
rate() { grep "^$1: default" "$OUT/attention.log" | sed 's/.*(\(.*\))/\1/'; }  # "2358 GB/s"
row() { ROWS+=("| $1 | $2 | $3 | $4 |"); }  # workload, figure, peer, target

for part in $PARTS; do
  case $part in
    w3)
      run w3_fp8 $LAT --model "$MODEL" --quantization fp8
      run w3_gptq4 $LAT --model "$GPTQ"
      run w3_bf16 $LAT --model "$MODEL"
      row "W3 FP8 weights, TPOT ms (#14)" "$(tpot w3_fp8)" "bf16 $(tpot w3_bf16)" "<= 2.3"
      row "W3 4-bit GPTQ, TPOT ms (#18)" "$(tpot w3_gptq4)" "bf16 $(tpot w3_bf16)" "<= 1.5" ;;
    w2)
      run w2_fp8 ${W2/--max-num-seqs 256/--max-num-seqs 512} --max-num-batched-tokens 16384 --quantization fp8 --kv-cache-dtype fp8
      run w2_bf16 $W2
      row "W2 FP8 weights + cache, output tok/s (#14)" "$(tok_s w2_fp8)" "bf16 $(tok_s w2_bf16)" ">= 18,000" ;;
    attention)  # the launcher's default tiles (one swept shape besides, to keep it short); each cache as the
      # engine lays it out: an 8-bit cache's values slot-minor within each block
      echo "=== attention: tune_attention.py, W2 decode 256x1500, bf16 and fp8 caches"
      (cd benchmarks && python3 tune_attention.py --cases "W2 decode 256x1500" --tile-n 64 --warps 4 --stages 2 --top 1 &&
        python3 tune_attention.py --cases "W2 decode 256x1500 fp8 cache" --layout slot-minor-values \
        --tile-n 64 --warps 1 --stages 3 --top 1) > "$OUT/attention.log" 2>&1 || echo "attention failed; see $OUT/attention.log"
      grep "default" "$OUT/attention.log"
      row "FP8 decode attention, 256 x 1,500 (#14)" "$(rate "W2 decode 256x1500 fp8 cache")" \
        "bf16 cache $(rate "W2 decode 256x1500")" ">= 3,500 GB/s" ;;
    tp2)
      run w3_tp2_bf16 $LAT --model "$MODEL" --tensor-parallel-size 2
      run w3_tp2_gptq4 $LAT --model "$GPTQ" --tensor-parallel-size 2
      row "W3 TP=2 bf16, TPOT ms (#16)" "$(tpot w3_tp2_bf16)" "4-bit TP=2 $(tpot w3_tp2_gptq4)" "<= 2.4" ;;
    *)
      echo "unknown part $part; valid: w3 w2 attention tp2" >&2
      exit 2 ;;
  esac
done

echo
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
echo "| workload | figure | peer, same run | target (H200) |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
