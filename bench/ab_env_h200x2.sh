#!/usr/bin/env bash
# An A/B of one environment setting in one call ON a lent GPU machine: bench_services.py once per value of
# $VAR, alternately (VALUES="0 10": 0, 10, 0, 10 with ROUNDS=2), each into $OUT/<value>_<round>/ (packed as
# <value>_<round>.tgz at the end) and followed by services_table.py. Every service the benchmark starts
# inherits the variable (SPECWIRE_ADMIT_WAIT_MS, SPECWIRE_SWITCH_INTERVAL, SPECWIRE_STREAM_INTERVAL, ...).
# SmolLM2, after the twenty-four staging calls (run_services_h200x2.sh `stage aa.0` ... `stage ac.7`),
# carry [".devcarry/wmin"]:
#   VAR=SPECWIRE_ADMIT_WAIT_MS VALUES="0 10" SPECWIRE_COMMIT=<sha> bash bench/ab_env_h200x2.sh \
#       --workloads smollm2 --setups target_only,colocated --smollm2-cache off --batch-sizes 16 \
#       --loads sustained --temperatures 0 --sweep-ks '' --repeats 8
# The 8B shape needs no staging: carry [".devcarry/wmin"], --workloads synthetic --lengths 3 ...
# DRAFTER_DEVICE / VERIFIER_DEVICE: default cuda:0 / cuda:1.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
M=${MODEL_DIR:-/root/m}
[ -n "${VAR:-}" ] && [ -n "${VALUES:-}" ] || { echo "set VAR and VALUES"; exit 2; }
if [ -f .devcarry/smol.part.ac ] || ls "$M"/smol.part.ac* > /dev/null 2>&1; then bash bench/join_model.sh || exit 3; fi
model=(); [ -f "$M/smol.gguf" ] && model=(--model "$M/smol.gguf")
source bench/device_env.sh
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # cuda:N is NVML's GPU N (bench/gpu_busy.py)
status=0
for round in $(seq "${ROUNDS:-2}"); do
    for value in $VALUES; do
        dir="$OUT/${value//,/_}_$round"; mkdir -p "$dir"  # a comma (or +) in a name: the archive does not come back
        env "$VAR=$value" timeout "${RUN_TIMEOUT:-200}" python3 bench/bench_services.py "${model[@]}" \
            --drafter-device "${DRAFTER_DEVICE:-cuda:0}" --verifier-device "${VERIFIER_DEVICE:-cuda:1}" \
            --out-dir "$dir" --tag "ab" --commit "${SPECWIRE_COMMIT:-?}" "$@" > "$dir/bench.log" 2>&1 \
            || status=$?
        echo "== $VAR=$value, round $round"
        for f in "$dir"/services_*.json; do python3 bench/services_table.py "$f" --temperature 0; done
    done
done
for value in $VALUES; do  # a call brings back at most 8 files: each run's folder travels as one archive
    for dir in "$OUT/${value//,/_}"_*; do
        [ -d "$dir" ] && tar -czf "$dir.tgz" -C "$OUT" "$(basename "$dir")" && rm -rf "$dir"
    done
done
exit $status
