#!/usr/bin/env bash
# Runs ON a lent GPU machine (the device tool), from the repo root, carry [".devcarry/wmin"]:
#   SPECWIRE_COMMIT=<sha> bash bench/switch_interval_ab.sh 0.005 0.0002        # one bench per interval
#   SPECWIRE_COMMIT=<sha> SPECWIRE_PROFILE_DIR=$OUT/profile bash bench/switch_interval_ab.sh 0.005  # traced
# The synthetic Llama-3.1-8B shape (no model to stage), target-only and drafter + verifier, batch 1 and 16,
# greedy, forced mean acceptance length 3 and cache hit rate 0.8, once per SPECWIRE_SWITCH_INTERVAL given
# (both services read it). Both services share GPU 0 unless DRAFTER_DEVICE / VERIFIER_DEVICE say otherwise;
# SPECWIRE_PROFILE_DIR=... makes each service write a torch.profiler trace of a window of its steps. $OUT gets one
# directory per interval (JSON, log). (py-spy --subprocesses sampled none of the services there: use the traces.)
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
source bench/device_env.sh
export CUDA_DEVICE_ORDER=PCI_BUS_ID
bench=(python3 bench/bench_services.py --workloads synthetic --lengths 3 --hit-rates 0.8
       --setups target_only,two_gpus --batch-sizes "${BATCHES:-1,16}" --temperatures 0 --sweep-ks ''
       --repeats 2 --drafter-device "${DRAFTER_DEVICE:-cuda:0}" --verifier-device "${VERIFIER_DEVICE:-cuda:0}"
       --budget-seconds 240)
status=0
for interval in "$@"; do
    dir="$OUT/si_$interval"
    mkdir -p "$dir"
    run=("${bench[@]}" --out-dir "$dir" --tag switch)
    SPECWIRE_SWITCH_INTERVAL=$interval timeout 290 "${run[@]}" > "$dir/bench.log" 2>&1 || status=$?
    tail -8 "$dir/bench.log"
done
exit $status
