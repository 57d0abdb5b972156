#!/usr/bin/env bash
# Runs ON nvidia-h200-x2 after the two staging calls of bench/README.md (carry [".devcarry/smol.part.ac", ".devcarry/wmin"]):
# SmolLM2 + the shipped head, target-only and two GPUs, under three verifier settings: the speculation cache
# as shipped, the cache with a 2 ms table wait, and serial drafting (no cache). One directory each under $OUT.
M=/root/m; cat $M/smol.part.aa $M/smol.part.ab .devcarry/smol.part.ac > $M/smol.gguf; source bench/device_env.sh >/dev/null 2>&1
export CUDA_DEVICE_ORDER=PCI_BUS_ID
for v in "default|" "wait2ms|--table-wait-ms 2" "serial|--cache-branches 0"; do
  name=${v%%|*}; extra=${v#*|}
  mkdir -p $OUT/$name
  timeout 170 python3 bench/bench_services.py --model $M/smol.gguf --workloads smollm2 --drafter-device cuda:0 --verifier-device cuda:1 --setups target_only,two_gpus --batch-sizes 1,16 --temperatures 0,1 --sweep-ks '' --repeats 3 --prompts bench/data/heldout_chat_sharegpt.jsonl --verifier-args "$extra" --out-dir $OUT/$name --tag $name --budget-seconds 150 > $OUT/$name/bench.log 2>&1
  grep -A8 "^smollm2" $OUT/$name/bench.log
done
