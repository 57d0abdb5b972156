source bench/device_env.sh >/dev/null 2>&1
export CUDA_DEVICE_ORDER=PCI_BUS_ID SPECWIRE_COMMIT=0787901
for n in 8 4 2; do
  mkdir -p $OUT/n$n
  if [ $n = 8 ]; then export SPECWIRE_PROFILE_DIR=$OUT/prof SPECWIRE_PROFILE_SKIP=30 SPECWIRE_PROFILE_STEPS=8; else unset SPECWIRE_PROFILE_DIR; fi
  timeout 200 python3 bench/bench_services.py --workloads synthetic --lengths 3 --hit-rates 0.8 --setups two_gpus --batch-sizes 16 --temperatures 0,1 --sweep-ks '' --repeats 2 --drafter-device cuda:0 --verifier-device cuda:0 --budget-seconds 150 --out-dir $OUT/n$n --tag n$n --synthetic-verifier-args "--aux-layers none --cache-branches $n" > $OUT/n$n/bench.log 2>&1
  python3 -c "
import json;d=json.load(open('$OUT/n$n/services_8b_synthetic_n$n.json'))
for r in d['results']: print('N=$n',r['setup'],r['batch'],r['temperature'],round(r['tokens_per_s']),r.get('cache'),{k:round(v,2) for k,v in r['round_ms'].items() if v is not None}, r['wire_bytes_per_step'])"
done
ls $OUT/prof
