#!/usr/bin/env bash
# Verifier-flag variants side by side, in one call ON nvidia-h200-x2 (or one GPU: DRAFTER_DEVICE=cuda:0
# VERIFIER_DEVICE=cuda:0). Each variant is a bench_services.py run of target-only and two GPUs at batch 1
# and 16, T = 0 and 1, into $OUT/<name>/:
#
#   bash bench/variants_h200x2.sh synthetic "jit|" "no_jit|--just-in-time-wait-ms 0"
#       carry [".devcarry/wmin"]: the 8B shape at forced tau 3 and hit rate 0.8
#   bash bench/variants_h200x2.sh smollm2 "jit|" "no_jit|--just-in-time-wait-ms 0" "serial|--cache-branches 0"
#       after the two staging calls of run_services_h200x2.sh, carry [".devcarry/smol.part.ac", ".devcarry/wmin"]
#
# SPECWIRE_COMMIT names the tree (the device's git may be stale). About 170 s a variant at most.
# SYNTHETIC_SHAPE=tiny DRAFTER_DEVICE=cpu VERIFIER_DEVICE=cpu tries the script on a CPU.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
workload=$1; shift
M=${MODEL_DIR:-/root/m}
args=(--workloads "$workload" --setups target_only,two_gpus --batch-sizes 1,16 --temperatures 0,1 --sweep-ks ''
      --repeats 3 --budget-seconds 150 --drafter-device "${DRAFTER_DEVICE:-cuda:0}"
      --verifier-device "${VERIFIER_DEVICE:-cuda:1}" --commit "${SPECWIRE_COMMIT:-?}")
if [ "$workload" = smollm2 ]; then
    bash bench/join_model.sh || exit 3
    args+=(--model "$M/smol.gguf" --prompts bench/data/heldout_chat_sharegpt.jsonl)
    flag=--verifier-args
else
    args+=(--lengths 3 --hit-rates 0.8 --synthetic-shape "${SYNTHETIC_SHAPE:-llama-3.1-8b}")
    flag=--synthetic-verifier-args
fi
source bench/device_env.sh > /dev/null 2>&1
export CUDA_DEVICE_ORDER=PCI_BUS_ID
for v in "$@"; do
    name=${v%%|*}; extra=${v#*|}
    mkdir -p "$OUT/$name"
    timeout 170 python3 bench/bench_services.py "${args[@]}" "$flag" "$extra" --out-dir "$OUT/$name" \
        --tag "$name" > "$OUT/$name/bench.log" 2>&1
    echo "== $name ($extra)"; grep -A10 "^$workload\|^synthetic" "$OUT/$name/bench.log"
done
