#!/usr/bin/env bash
# Runs ON a lent GPU machine (the device tool), from the repo root, carry [".devcarry/wmin", ".devcarry/tools"]:
#   SPECWIRE_COMMIT=<sha> bash bench/switch_interval_ab.sh 0.005 0.0002        # one bench per interval
#   SPECWIRE_COMMIT=<sha> PYSPY=1 bash bench/switch_interval_ab.sh 0.005       # the same under py-spy
# The synthetic Llama-3.1-8B shape (no model to stage), target-only and drafter + verifier, batch 1 and 16,
# greedy, forced mean acceptance length 3 and cache hit rate 0.8, once per SPECWIRE_SWITCH_INTERVAL given
# (both services read it). Both services share GPU 0 unless DRAFTER_DEVICE / VERIFIER_DEVICE say otherwise;
# SPECWIRE_PROFILE_DIR=... makes each service write a torch.profiler trace of a window of its steps. $OUT gets one
# directory per interval (JSON, log) and, with PYSPY=1, py-spy's raw stacks of every process and thread.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
source bench/device_env.sh
export CUDA_DEVICE_ORDER=PCI_BUS_ID
if [ -n "${PYSPY:-}" ]; then
    python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .devcarry/tools/py_spy-*.whl || exit 3
fi
bench=(python3 bench/bench_services.py --workloads synthetic --lengths 3 --hit-rates 0.8
       --setups target_only,two_gpus --batch-sizes "${BATCHES:-1,16}" --temperatures 0 --sweep-ks ''
       --repeats 2 --drafter-device "${DRAFTER_DEVICE:-cuda:0}" --verifier-device "${VERIFIER_DEVICE:-cuda:0}"
       --budget-seconds 240)
status=0
for interval in "$@"; do
    dir="$OUT/si_$interval"
    mkdir -p "$dir"
    run=("${bench[@]}" --out-dir "$dir" --tag switch)
    if [ -n "${PYSPY:-}" ]; then
        run=(/tmp/site/bin/py-spy record --subprocesses --threads --nonblocking -r 200 -f raw
             -o "$dir/pyspy_raw.txt" -- "${run[@]}")
    fi
    SPECWIRE_SWITCH_INTERVAL=$interval timeout 290 "${run[@]}" > "$dir/bench.log" 2>&1 || status=$?
    tail -8 "$dir/bench.log"
done
exit $status
