#!/bin/bash
# The doctor's per-step cost on the GPU, in one device call: the CUDA tests (all of them
# with ALL_CUDA=1, else the doctor's and the train step's), then seed_mlp's eager step armed
# against off (doctor_ab.py, twice, and its control twice, interleaved; once with no-op
# hooks only), each piece's host time (doctor_host_cost.py), the host's cost of the calls
# the doctor makes and a cProfile of armed steps (doctor_primitives.py), the step's phases
# (doctor_phases.py) and the transformer's A/B. Everything is packed into all.tar.gz in the
# folder given, beside card.txt and summary.txt (the device returns at most 8 files).
#   bash benchmarks/gpu/doctor_overhead.sh "$OUT"   [AB_ARGS="--chunk 20 --chunks 120"]
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${1:?give an output folder}
mkdir -p "$dest"
out=$(mktemp -d)
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ab=${AB_ARGS:---chunk 20 --chunks 120}
pack() { tar czf "$dest/all.tar.gz" -C "$out" .; cp "$out/card.txt" "$out/summary.txt" "$dest/" 2>/dev/null; }
trap pack EXIT
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
  echo "commit: ${AMPKIT_GIT_COMMIT:-unknown}"; } | tee "$out/card.txt"
{
if [ "${ALL_CUDA:-0}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -m cuda tests/python \
    --ignore=tests/python/test_scaler_property.py --ignore=tests/python/test_bench_r.py > "$out/pytest_cuda.log" 2>&1
else
  python3 -m pytest -q -p no:cacheprovider -m cuda tests/python/test_doctor_cuda.py tests/python/test_doctor.py \
    tests/python/test_doctor_repair.py tests/python/test_train_step.py tests/python/test_train_step_cuda.py \
    > "$out/pytest_cuda.log" 2>&1
fi
echo "pytest -m cuda: rc=$? $(tail -1 "$out/pytest_cuda.log")"
python3 benchmarks/probes/doctor_ab.py $ab --noop-hooks --json "$out/ab-seed_mlp-noop-hooks.json"
for i in 1 2; do
  python3 benchmarks/probes/doctor_ab.py $ab --json "$out/ab-seed_mlp-$i.json"
  python3 benchmarks/probes/doctor_ab.py $ab --control --json "$out/ab-seed_mlp-control-$i.json"
done
python3 benchmarks/probes/doctor_host_cost.py --steps 400
python3 benchmarks/probes/doctor_primitives.py
python3 benchmarks/probes/doctor_phases.py --chunks 60
python3 benchmarks/probes/doctor_ab.py --case transformer --chunk 4 --chunks 30 --json "$out/ab-transformer.json"
} 2>&1 | tee "$out/summary.txt"
