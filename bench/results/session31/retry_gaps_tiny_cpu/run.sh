. /work/main/.venv/bin/activate
for pair in old1:/tmp/wt_before:cb90881 new1:/work/main:e051042 old2:/tmp/wt_before:cb90881 new2:/work/main:e051042 old3:/tmp/wt_before:cb90881 new3:/work/main:e051042; do
  name=${pair%%:*}; rest=${pair#*:}; tree=${rest%%:*}; commit=${rest#*:}
  cd $tree && mkdir -p /tmp/ab31/$name && export PYTHONPATH=$tree
  date -u +%FT%TZ > /tmp/ab31/$name/started; python3 -c "import specwire.verifier.drafting_mode as d; print(d.__file__, \"max_gap\" in open(d.__file__).read())" > /tmp/ab31/$name/which
  python3 bench/bench_services.py --workloads synthetic --setups target_only,two_gpus --batch-sizes 1,16 \
    --temperatures 0 --sweep-ks '' --repeats 3 --lengths 3 --hit-rates 0.8 --synthetic-shape tiny \
    --drafter-device cpu --verifier-device cpu --synthetic-verifier-args "--drafting-epoch 16" \
    --budget-seconds 400 --commit $commit --out-dir /tmp/ab31/$name --tag $name > /tmp/ab31/$name/bench.log 2>&1
  date -u +%FT%TZ > /tmp/ab31/$name/ended
done
echo ALLDONE > /tmp/ab31/done
