#!/usr/bin/env bash
# NUMA placement probe: which CPUs are local to GPU 0, and SmolLM2-shape co-located runs pinned local vs remote.
set -uo pipefail
OUT=${OUT:-/tmp/specwire-out}
nvidia-smi topo -m 2>&1 | head -8
lscpu | grep -iE "numa|socket|model name|^cpu\(s\)"
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f')
sys=/sys/bus/pci/devices/${bus: -12}
echo "gpu0 $bus numa_node=$(cat $sys/numa_node) local_cpulist=$(cat $sys/local_cpulist)"
for n in /sys/devices/system/node/node*; do echo "$(basename $n): $(cat $n/cpulist)"; done
echo "allowed: $(taskset -pc $$)"
source bench/device_env.sh > /dev/null 2>&1
node=$(cat $sys/numa_node)
local=$(cat $sys/local_cpulist)
remote=$(for n in /sys/devices/system/node/node*; do [ "$(basename $n)" != "node$node" ] && cat $n/cpulist; done | head -1)
[ "$node" = "-1" ] && remote=""
sides="local remote local remote"; [ -z "$remote" ] && sides="any any any"
i=0
for side in $sides; do
    i=$((i+1)); cpus=$local; [ $side = remote ] && cpus=$remote
    pin=(taskset -c "$cpus"); [ $side = any ] && pin=()
    "${pin[@]}" timeout 150 python3 bench/bench_services.py --workloads synthetic --synthetic-shape smollm2-135m \
        --setups target_only,colocated --lengths 3 --colocated-lengths 3 --hit-rates off --batch-sizes ${BS:-1,16} \
        --temperatures 0 --loads batch --sweep-ks '' --repeats ${REPEATS:-6} --drafter-device cuda:0 --verifier-device cuda:0 \
        --out-dir $OUT/${i}_$side --tag $side --commit ${SPECWIRE_COMMIT:-?} > $OUT/${i}_$side.log 2>&1
    echo "== $i $side ($cpus) rc=$?"
    python3 bench/services_table.py $OUT/${i}_$side/services_*.json --temperature 0 | grep -v "^| ---" | cut -d'|' -f2,6,8,9,10,13,15
done
