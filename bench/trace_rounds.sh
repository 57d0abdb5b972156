#!/usr/bin/env bash
# Where a round's time goes, ON a lent two-GPU machine after the staging calls of run_services_h200x2.sh (carry
# [".devcarry/smol.part.ac", ".devcarry/wmin"]): for each workload in WORKLOADS (default "smollm2 synthetic"),
# one bench_services.py run of target-only and SETUPS (default the two-GPU socket setup; cache on and off,
# batch 1 and 16, greedy, forced tau 3 for the 8B shape) with the round marks of specwire/round_trace.py on, then
# bench/round_timeline.py's tables. Extra arguments go to bench_services.py and override these. With PYSPY set
# (carry .devcarry/pyspy), py-spy samples every process of the run at 250 Hz into pyspy.txt (collapsed stacks).
# $OUT gets timeline_<workload>.txt and trace_rounds.tgz (the runs' JSON, logs, raw marks and timelines).
# DRAFTER_DEVICE / VERIFIER_DEVICE (default cuda:0 / cuda:1) put both processes on one GPU where only one is lent.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
M=${MODEL_DIR:-/root/m}
bash bench/join_model.sh || exit 3
source bench/device_env.sh > /dev/null 2>&1
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # cuda:N is NVML's GPU N (bench/gpu_busy.py)
runs=()
profile=()
if [ -n "${PYSPY:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/pyspy .devcarry/pyspy/*.whl
    profile=(/tmp/pyspy/bin/py-spy record --subprocesses --nonblocking -r 250 --format raw -o)
fi
for w in ${WORKLOADS:-smollm2 synthetic}; do
    mkdir -p "$OUT/$w"
    SPECWIRE_TRACE_DIR="$OUT/$w/trace" ${profile[@]:+"${profile[@]}" "$OUT/$w/pyspy.txt" --} python3 bench/bench_services.py --model "$M/smol.gguf" \
        --drafter-device "${DRAFTER_DEVICE:-cuda:0}" --verifier-device "${VERIFIER_DEVICE:-cuda:1}" \
        --out-dir "$OUT/$w" --tag trace --workloads "$w" \
        --setups target_only,${SETUPS:-two_gpus_socket} --smollm2-cache on,off --lengths 3 --hit-rates 0.8,off \
        --batch-sizes 1,16 --temperatures 0 --sweep-ks '' --repeats 4 "$@" > "$OUT/$w/bench.log" 2>&1
    echo "== $w (exit $?)"
    for f in "$OUT/$w"/services_*.json; do python3 bench/services_table.py "$f" --temperature 0; done
    python3 bench/round_timeline.py "$OUT/$w/trace" --json "$OUT/$w/timeline.json" > "$OUT/timeline_$w.txt"
    runs+=("$w")
done
tar -czf "$OUT/trace_rounds.tgz" -C "$OUT" "${runs[@]}" && rm -rf "${runs[@]/#/$OUT/}"
