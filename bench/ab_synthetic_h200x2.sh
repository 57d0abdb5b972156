#!/usr/bin/env bash
# A before/after A/B of the services. Runs ON nvidia-h200-x2, carry [".devcarry/wmin", ".devcarry/old"] where .devcarry/old is `git archive <before>`
# of the commit to compare with (its heads/ left out: the synthetic shape needs none). The 8B shape (forced
# tau 3, hit 0.8), target-only and two GPUs, batch 1 and 16, T = 0 and 1, first in the old tree, then in
# this one, in one call: $OUT/before and $OUT/after. DRAFTER_DEVICE / VERIFIER_DEVICE (default cuda:0 / cuda:1)
# put both services on one GPU where no two-GPU machine is lent.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
source bench/device_env.sh > /dev/null 2>&1  # installs the carried wheels into /tmp/site for both trees
for side in before after; do
    tree=.; [ $side = before ] && tree=.devcarry/old
    mkdir -p "$OUT/$side"
    (cd "$tree" && source bench/device_env.sh > /dev/null 2>&1 && export CUDA_DEVICE_ORDER=PCI_BUS_ID &&
     timeout 170 python3 bench/bench_services.py --workloads synthetic --lengths 3 --hit-rates 0.8 \
        --setups target_only,two_gpus --batch-sizes 1,16 --temperatures 0,1 --sweep-ks '' --repeats 3 \
        --drafter-device "${DRAFTER_DEVICE:-cuda:0}" --verifier-device "${VERIFIER_DEVICE:-cuda:1}" --out-dir "$OUT/$side" --tag "$side" \
        --commit "${1:-?}-$side" --budget-seconds 150 > "$OUT/$side/bench.log" 2>&1)
    grep -A10 "^synthetic" "$OUT/$side/bench.log"
done
