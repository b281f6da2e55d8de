#!/bin/bash
# The doctor's per-step cost on the GPU, in one device call: its CUDA tests (and the train
# step's), then seed_mlp's eager step armed against off (doctor_ab.py, twice, and its
# control twice, interleaved), each piece's host time (doctor_host_cost.py) and the
# cProfile difference armed - off (doctor_profile_diff.py). Results go to the folder given.
#   bash benchmarks/gpu/doctor_overhead.sh "$OUT"   [AB_ARGS="--chunk 20 --chunks 120"]
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${1:?give an output folder}
mkdir -p "$dest"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ab=${AB_ARGS:---chunk 20 --chunks 120}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
  echo "commit: ${AMPKIT_GIT_COMMIT:-unknown}"; } | tee "$dest/card.txt"
python3 -m pytest -q -p no:cacheprovider -m cuda tests/python/test_doctor_cuda.py tests/python/test_doctor.py tests/python/test_doctor_repair.py \
  tests/python/test_train_step.py tests/python/test_train_step_cuda.py > "$dest/pytest_doctor_cuda.log" 2>&1
echo "pytest -m cuda (doctor, train step): rc=$? $(tail -1 "$dest/pytest_doctor_cuda.log")"
python3 benchmarks/probes/doctor_ab.py $ab --noop-hooks --json "$dest/ab-seed_mlp-noop-hooks.json"
for i in 1 2; do
  python3 benchmarks/probes/doctor_ab.py $ab --json "$dest/ab-seed_mlp-$i.json"
  python3 benchmarks/probes/doctor_ab.py $ab --control --json "$dest/ab-seed_mlp-control-$i.json"
done
python3 benchmarks/probes/doctor_host_cost.py --steps 400 | tee "$dest/host_cost.txt"
python3 benchmarks/probes/doctor_profile_diff.py --steps 600 --top 40 | tee "$dest/profile_diff.txt"
python3 benchmarks/probes/doctor_ab.py --case transformer --chunk 4 --chunks 30 --json "$dest/ab-transformer.json"
python3 benchmarks/probes/doctor_phases.py --chunks 60 2>&1 | grep -v Warning | tee "$dest/phases.txt"
