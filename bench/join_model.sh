#!/usr/bin/env bash
# Joins the default model on a lent GPU machine, once, from the repo root: $MODEL_DIR (default /root/m)/smol.gguf
# from its three parts staged there (bench/run_services_h200x2.sh `stage ...`), each whole or as two halves,
# the third also taken from .devcarry/smol.part.ac when a call carries it. Written under another name and then
# renamed, so a failed join leaves no partial model behind for a later call to take as joined.
set -uo pipefail
M=${MODEL_DIR:-/root/m}
[ -f "$M/smol.gguf" ] && exit 0
# Halves (`stage aa.aa`, `stage aa.ab`, ...: .devcarry/smol.part.??.a?, made by bench/stage_device.sh) are for a
# tree that leaves a call less than a whole part's 33 MB of carry.
for p in aa ab ac; do
    if [ ! -f "$M/smol.part.$p" ] && [ -f "$M/smol.part.$p.aa" ] && [ -f "$M/smol.part.$p.ab" ]; then
        cat "$M/smol.part.$p.aa" "$M/smol.part.$p.ab" > "$M/smol.part.$p"
    fi
done
# The third part is carried, or staged like the first two (`stage ac`) when the call's carry would pass 64 MiB.
third=.devcarry/smol.part.ac; [ -f "$third" ] || third="$M/smol.part.ac"
for part in "$M/smol.part.aa" "$M/smol.part.ab" "$third"; do
    [ -f "$part" ] || { echo "no $part: stage the model (the staging calls of bench/run_services_h200x2.sh;" \
                             "the machine may have gone back)" >&2; exit 3; }
done
cat "$M/smol.part.aa" "$M/smol.part.ab" "$third" > "$M/smol.gguf.joining" &&
    mv "$M/smol.gguf.joining" "$M/smol.gguf"
