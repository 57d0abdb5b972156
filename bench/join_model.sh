#!/usr/bin/env bash
# Joins the default model on a lent GPU machine, once, from the repo root: $MODEL_DIR (default /root/m)/smol.gguf
# from the two parts staged there (calls 1 and 2 of bench/run_services_h200x2.sh) and the third, carried as
# .devcarry/smol.part.ac. Written under another name and then renamed, so a failed join leaves no partial
# model behind for a later call to take as joined.
set -uo pipefail
M=${MODEL_DIR:-/root/m}
[ -f "$M/smol.gguf" ] && exit 0
# A part may have been staged as two halves (`stage aa.aa`, `stage aa.ab`: .devcarry/smol.part.??.a?, made by
# bench/stage_device.sh), when the tree leaves a call less than a whole part's 33 MB of carry.
for p in aa ab ac; do
    if [ ! -f "$M/smol.part.$p" ] && [ -f "$M/smol.part.$p.aa" ] && [ -f "$M/smol.part.$p.ab" ]; then
        cat "$M/smol.part.$p.aa" "$M/smol.part.$p.ab" > "$M/smol.part.$p"
    fi
done
# The third part is carried, or staged like the first two (`stage ac`) when the call's carry would pass 64 MiB.
third=.devcarry/smol.part.ac; [ -f "$third" ] || third="$M/smol.part.ac"
for part in "$M/smol.part.aa" "$M/smol.part.ab" "$third"; do
    [ -f "$part" ] || { echo "no $part: stage the model (calls 1 and 2 of bench/run_services_h200x2.sh; the" \
                             "machine may have gone back) and carry .devcarry/smol.part.ac (or stage it)" >&2; exit 3; }
done
cat "$M/smol.part.aa" "$M/smol.part.ab" "$third" > "$M/smol.gguf.joining" &&
    mv "$M/smol.gguf.joining" "$M/smol.gguf"
