. /work/main/.venv/bin/activate
for pair in m1:/work/main:358eb98 m2:/work/main:358eb98 m3:/work/main:358eb98 m4:/work/main:358eb98; do
  name=${pair%%:*}; rest=${pair#*:}; tree=${rest%%:*}; commit=${rest#*:}
  cd $tree && mkdir -p /tmp/ab_none/$name
  date -u +%FT%TZ > /tmp/ab_none/$name/started
  python3 bench/bench_services.py --workloads synthetic --setups target_only,two_gpus --batch-sizes 1,16 \
    --temperatures 0 --sweep-ks '' --repeats 3 --lengths 3 --hit-rates 0.8 --synthetic-shape tiny \
    --drafter-device cpu --verifier-device cpu --synthetic-verifier-args "--drafting-epoch 16" \
    --budget-seconds 400 --commit $commit --out-dir /tmp/ab_none/$name --tag $name > /tmp/ab_none/$name/bench.log 2>&1
  date -u +%FT%TZ > /tmp/ab_none/$name/ended
done
echo ALLDONE > /tmp/ab_none/done
