#!/usr/bin/env bash
# Where a speculative round's time goes, on a lent GPU machine after bench/run_services_h200x2.sh has joined
# the model (same lease): one short bench_services.py run (arguments: its flags, e.g. --workloads smollm2
# --setups two_gpus --smollm2-cache off --batch-sizes 1) under py-spy, every process and thread sampled at
# PYSPY_RATE Hz (default 1000) without pausing them, idle time included (a thread waiting for the GIL or the
# device is sampled where it waits: bench/pyspy_drill.py), and torch.profiler traces of both services' steps
# (specwire/step_profiler.py). Carry [".devcarry/wmin", ".devcarry/pyspy"]; with no model joined (a synthetic
# run: --workloads synthetic ...) the run goes without --model.
# DRAFTER_DEVICE / VERIFIER_DEVICE: default cuda:0 / cuda:1 (one GPU: both cuda:0).
# $OUT/profile.tar.gz gets the raw py-spy stacks (pyspy.txt), the traces and op tables, and the run's JSON.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
M=${MODEL_DIR:-/root/m}
P=$(mktemp -d /tmp/specwire-profile-XXXX)
source bench/device_env.sh >/dev/null
# its own target: pip --target leaves an existing /tmp/site/bin (gguf's scripts) without py-spy's binary
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/pyspy .devcarry/pyspy/*.whl || exit 3
model=(); [ -f "$M/smol.gguf" ] && model=(--model "$M/smol.gguf")
export CUDA_DEVICE_ORDER=PCI_BUS_ID SPECWIRE_PROFILE_DIR=$P/traces
export SPECWIRE_PROFILE_SKIP=${SPECWIRE_PROFILE_SKIP:-300} SPECWIRE_PROFILE_STEPS=${SPECWIRE_PROFILE_STEPS:-40}
/tmp/pyspy/bin/py-spy record --subprocesses --nonblocking --threads --idle --rate "${PYSPY_RATE:-1000}" --format raw \
    --output "$P/pyspy.txt" -- \
    python3 bench/bench_services.py "${model[@]}" --drafter-device "${DRAFTER_DEVICE:-cuda:0}" --verifier-device "${VERIFIER_DEVICE:-cuda:1}" \
    --out-dir "$P" --tag profile --sweep-ks "" --temperatures 0 --repeats 3 "$@" 2>&1 | tail -12
status=${PIPESTATUS[0]}
tar -czf "$OUT/profile.tar.gz" -C "$P" . && ls -la "$OUT/profile.tar.gz"
exit "$status"
