#!/usr/bin/env bash
# Which thread of the co-located verifier burns a CPU while it serves: top -H (OS thread ids) and py-spy dump.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
source bench/device_env.sh > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/pyspy .devcarry/pyspy/*.whl > /dev/null 2>&1
python3 bench/bench_services.py --workloads synthetic --synthetic-shape smollm2-135m --setups colocated \
    --lengths 3 --colocated-lengths 3 --hit-rates off --batch-sizes 16 --temperatures 0 --loads batch \
    --sweep-ks '' --repeats 100 --drafter-device cuda:0 --verifier-device cuda:0 \
    --out-dir $OUT/run --tag busy --commit ${SPECWIRE_COMMIT:-?} > $OUT/bench.log 2>&1 &
bench=$!
for t in $(seq 90); do
    pid=$(pgrep -f -- "verifier .*--colocated" | head -1)
    [ -n "$pid" ] && grep -q "colocated k=4" $OUT/bench.log 2>/dev/null && break
    sleep 1
done
port=$(tr '\0' ' ' < /proc/$pid/cmdline | grep -oE -- "--metrics-port [0-9]+" | cut -d' ' -f2)
for t in $(seq 120); do  # serving: tokens counted
    n=$(curl -s 127.0.0.1:$port/metrics | grep -E "^specwire_generation_tokens_total" | awk '{print $2}')
    [ -n "$n" ] && [ "${n%.*}" -gt 20000 ] && break
    sleep 0.5
done
echo "generation tokens so far: $n"
top -b -n 1 -H -p $pid -d 1 | sed -n 7,14p
/tmp/pyspy/bin/py-spy dump --pid $pid --native 2>&1 | head -150 > $OUT/dump1.txt
top -b -n 1 -H -p $pid -d 1 | sed -n 7,12p
/tmp/pyspy/bin/py-spy dump --pid $pid 2>&1 | head -120 > $OUT/dump2.txt
cat /proc/$pid/task/*/comm | sort | uniq -c
for t in /proc/$pid/task/*; do echo "$(basename $t) $(cat $t/comm) $(awk '{print $14+$15}' $t/stat)"; done | sort -k3 -n | tail -6
wait $bench
grep -E "^Thread|^Process" $OUT/dump2.txt
