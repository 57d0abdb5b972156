#!/usr/bin/env bash
# Train the EAGLE-3 head for the default model on one lent GPU, and measure it beside the shipped head.
# Runs from /root/work (this tree, unpacked there), with the model joined at /root/m/smol.gguf.
#   start  REPO: install, then launch train-eagle detached (setsid: it outlives this call while the machine
#                stays warm) and follow its log for up to FOLLOW seconds
#   finish:      wait for training to end, then bench both heads at T = 0 and T = 1; results to $OUT
set -uo pipefail
W=/root/work M=/root/m R=/root/run
PROMPTS=bench/data/heldout_chat_sharegpt.jsonl
cd "$W" && source bench/device_env.sh

follow() {  # print the log's progress until the trainer ends or $1 seconds pass
    local end=$((SECONDS + $1))
    while [ $SECONDS -lt $end ] && [ ! -f $R/exit_code ]; do sleep 20; tail -c 400 $R/train.log | tr '\r' '\n' | tail -2; done
}

case "$1" in
start)
    REPO=$2
    mkdir -p $R
    [ -f $M/smol.gguf ] || cat $M/smol.part.aa "$REPO"/.devcarry/head/smol.part.ab > $M/smol.gguf
    md5sum $M/smol.gguf
    python3 -m pip install -q --no-index --no-deps --target /tmp/site "$REPO"/.devcarry/head/gguf-*.whl
    mkdir -p drafter_service/heads && cp -r "$REPO"/drafter_service/heads/smollm2-135m-eagle drafter_service/heads/
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    setsid bash -c "python3 -m specwire train-eagle --model $M/smol.gguf --data-dir .data \
        --chat-prompts .data/chat_prompts.npz --out $R/head --checkpoint $R/ckpt --device cuda \
        --max-minutes ${MINUTES:-15} --gen-fraction ${GEN_FRACTION:-0.33} --gen-batch 256 --self-instruct 2000 \
        --draft-vocab ${DRAFT_VOCAB:-8192} > $R/train.log 2>&1; echo \$? > $R/exit_code" < /dev/null &
    follow "${FOLLOW:-480}"
    ;;
finish)
    follow "${WAIT:-520}"
    [ -f $R/exit_code ] || { echo "training still running"; exit 3; }
    echo "train-eagle exit code $(cat $R/exit_code)"; tail -c 1500 $R/train.log
    for t in 0 1; do
        for h in new shipped; do
            head=$R/head; [ $h = shipped ] && head=drafter_service/heads/smollm2-135m-eagle
            python3 -m specwire bench --local --prompts $PROMPTS --k 4 --temperature $t --max-tokens 128 \
                --model $M/smol.gguf --head $head --batch 32 --json > "$OUT/acceptance_${h}_T$t.json"
            python3 - "$OUT/acceptance_${h}_T$t.json" "$head" "$t" <<'PY'
import json, sys, time, torch
path, head, t = sys.argv[1:]
d = json.load(open(path))
d["provenance"] = {
    "command": f"python3 -m specwire bench --local --prompts bench/data/heldout_chat_sharegpt.jsonl --k 4 "
               f"--temperature {t} --max-tokens 128 --model /root/m/smol.gguf --head {head} --batch 32 --json",
    "machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "commit": __import__("os").environ.get("SPECWIRE_COMMIT", "unknown")}
json.dump(d, open(path, "w"), indent=1)
print(path, d["mean_acceptance_length"], d["acceptance_per_position"])
PY
        done
    done
    cp $R/head/config.json $R/head/train_log.json "$OUT"/
    split -b 15000000 $R/head/model.safetensors "$OUT"/model.safetensors.part.
    ls -la "$OUT"
    ;;
esac
