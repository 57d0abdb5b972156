#!/usr/bin/env bash
# The co-located slow mode: N runs of the SmolLM2-shape co-located setup at batch 16 (static), each with the
# verifier process's threads sampled (ps -L: cpu share, cpu placed on) while it serves.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
source bench/device_env.sh > /dev/null 2>&1
lscpu -e | head -20
for i in $(seq ${RUNS:-5}); do
    d=$OUT/run$i; mkdir -p $d
    python3 bench/bench_services.py --workloads synthetic --synthetic-shape smollm2-135m --setups colocated \
        --lengths 3 --colocated-lengths 3 --hit-rates off --batch-sizes 16 --temperatures 0 --loads batch \
        --sweep-ks '' --repeats ${REPEATS:-40} --drafter-device cuda:0 --verifier-device cuda:0 \
        --out-dir $d --tag slow --commit ${SPECWIRE_COMMIT:-?} > $d/bench.log 2>&1 &
    bench=$!
    for t in $(seq 60); do
        pid=$(pgrep -f -- "verifier .*--colocated" | head -1)
        [ -n "$pid" ] && grep -q "colocated k=4" $d/bench.log 2>/dev/null && break
        sleep 1
    done
    sleep 4
    for s in 1 2 3; do
        echo "-- sample $s"; ps -L -o tid,psr,pcpu,stat,comm -p $pid | sort -k3 -nr | head -12
        top -b -n 1 -H -p $pid -d 1 | sed -n 7,16p
        sleep 1
    done > $d/threads.txt 2>&1
    wait $bench
    echo "== run $i"; python3 bench/services_table.py $d/services_*.json --temperature 0 | grep colocated | cut -d'|' -f2,6,8,12,14,15
    cat $d/threads.txt | head -30
done
