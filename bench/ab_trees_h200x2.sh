#!/usr/bin/env bash
# A before/after A/B of the services in one call ON nvidia-h200-x2: an older commit's tree against this one,
# alternately (before, after, before, after: ROUNDS=2), each a bench_services.py run of the given arguments
# into $OUT/<side>_<round>/ (packed as <side>_<round>.tgz at the end: a call brings back 8 files), then
# services_table.py of every run. The older tree is carried as .devcarry/old:
#
#   rm -rf .devcarry/old && mkdir -p .devcarry/old && git archive <before> | tar -x -C .devcarry/old \
#       --exclude=drafter_service/heads --exclude=bench/results --exclude=docs --exclude=tests --exclude=k8s
#   (this tree's heads are linked in; the rest is not run, and the carry is at most 64 MiB)
#
# SmolLM2, after the twenty-four staging calls (run_services_h200x2.sh `stage aa.0` ... `stage ac.7`),
# carry [".devcarry/wmin", ".devcarry/old"]:
#   BEFORE=<sha> AFTER=<sha> bash bench/ab_trees_h200x2.sh --workloads smollm2 --setups target_only,two_gpus_socket \
#       --smollm2-cache off --batch-sizes 1,16 --temperatures 0 --sweep-ks '' --repeats 20
# The 8B shape, carry [".devcarry/wmin", ".devcarry/old"]:
#   BEFORE=<sha> AFTER=<sha> bash bench/ab_trees_h200x2.sh --workloads synthetic --lengths 3 --hit-rates 0.8 \
#       --setups target_only,two_gpus --batch-sizes 1,16 --temperatures 0 --sweep-ks '' --repeats 3
# Pass --paired (bench_services.py) to measure each speculative point against target-only batches run between its
# own on a second verifier, so the machine's drift between configurations cancels (the trees must both have it).
# DRAFTER_DEVICE / VERIFIER_DEVICE (default cuda:0 / cuda:1) put both services on one GPU. TRACE=1 records the
# rounds' marks (specwire/round_trace.py) of each run, and bench/round_timeline.py's tables of them.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
M=${MODEL_DIR:-/root/m}
[ -d .devcarry/old/bench ] || { echo "no .devcarry/old: carry git archive <before> there"; exit 3; }
if [ -f .devcarry/smol.part.ac ] || ls "$M"/smol.part.ac* > /dev/null 2>&1; then  # carried: the runs are SmolLM2's
    bash bench/join_model.sh || exit 3
fi
model=(); [ -f "$M/smol.gguf" ] && model=(--model "$M/smol.gguf")
ln -sfn "$PWD/drafter_service/heads" .devcarry/old/drafter_service/heads
source bench/device_env.sh > /dev/null 2>&1  # installs the carried wheels into /tmp/site for both trees
export CUDA_DEVICE_ORDER=PCI_BUS_ID
for round in $(seq "${ROUNDS:-2}"); do
    for side in before after; do
        tree=.; commit=${AFTER:-?}; [ $side = before ] && tree=.devcarry/old commit=${BEFORE:-?}
        dir="$OUT/${side}_$round"; mkdir -p "$dir"
        (cd "$tree" && source bench/device_env.sh > /dev/null 2>&1 &&
         if [ -n "${TRACE:-}" ]; then export SPECWIRE_TRACE_DIR="$dir/trace"; fi &&
         timeout "${RUN_TIMEOUT:-200}" python3 bench/bench_services.py "${model[@]}" \
            --drafter-device "${DRAFTER_DEVICE:-cuda:0}" --verifier-device "${VERIFIER_DEVICE:-cuda:1}" \
            --out-dir "$dir" --tag "$side" --commit "$commit-$side" "$@" > "$dir/bench.log" 2>&1)
        echo "== $side, round $round (exit $?)"
        for f in "$dir"/services_*.json; do python3 bench/services_table.py "$f" --temperature 0; done
        if [ -d "$dir/trace" ]; then  # TRACE=1 (a tree with specwire/round_trace.py): the rounds' timelines
            python3 bench/round_timeline.py "$dir/trace" --json "$dir/timeline.json" > "$dir/timeline.txt"
            tar -czf "$dir/trace.tgz" -C "$dir" trace && rm -rf "$dir/trace"
        fi
    done
done
# A call brings back at most 8 files: each run's folder travels as one archive.
for dir in "$OUT"/before_* "$OUT"/after_*; do  # (archives an earlier call left in $OUT match too: skipped)
    if [ -d "$dir" ]; then tar -czf "$dir.tgz" -C "$OUT" "$(basename "$dir")" && rm -rf "$dir"; fi
done
