#!/usr/bin/env bash
# Run HERE (this checkout), around the calls that stage the model on a lent GPU machine. A call carries 64 MiB in
# all, the tree that travels included (~62 MB), so the 98 MB GGUF went in twenty-four eighths beside the tree.
# `on` takes every file out of git's index and ignores everything, so nothing travels but what a call carries:
# two calls then stage the model's three 33 MB parts (session 29), e.g.
#   carry [".devcarry/smol.part.aa", ".devcarry/smol.part.ab"]:  mkdir -p /root/m && cp .devcarry/smol.part.a? /root/m/
#   carry [".devcarry/smol.part.ac"]:                             cp .devcarry/smol.part.ac /root/m/
# (bench/join_model.sh takes whole parts as they are). `off` restores the index from HEAD and the ignore file.
# `lean` keeps the tree but leaves bench/results/ behind (the tree passed the 64 MiB a call carries in session 35);
# `off` restores either. Working files are never touched; `on` and `lean` refuse while there are uncommitted
# changes, and install a pre-commit hook that refuses commits until `off`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=.git/info/exclude
case "${1:-}" in
on|lean)
    [ -f $exclude.bare ] && { echo "already bare or lean (bench/bare_tree.sh off restores)"; exit 0; }
    git diff --quiet && git diff --cached --quiet || { echo "uncommitted changes: commit them first" >&2; exit 1; }
    touch $exclude && cp $exclude $exclude.bare
    # A commit now would record the index's removals (session 36 committed bench/results/ away once): refused.
    mkdir -p .git/hooks && printf '#!/bin/sh\n[ ! -f .git/info/exclude.bare ] || { echo "bench/bare_tree.sh: run off before committing" >&2; exit 1; }\n' \
        > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit
    if [ "$1" = on ]; then left='*' gone=.; else left=bench/results/ gone=bench/results; fi
    echo "$left" >> $exclude
    git rm -r -q --cached "$gone"
    echo "$1: $(git ls-files | wc -l) files travel"
    ;;
off)
    [ -f $exclude.bare ] || { echo "not bare or lean"; exit 0; }
    mv $exclude.bare $exclude
    git reset -q
    echo "restored: $(git ls-files | wc -l) files tracked; git status:"; git status --short | head
    ;;
*)
    echo "usage: bench/bare_tree.sh on|lean|off" >&2; exit 2
    ;;
esac
