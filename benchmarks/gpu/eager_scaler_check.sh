#!/bin/bash
# The eager-speed check of the scaler and region: the CUDA scaler and train-step tests,
# then ampkit's eager AMP loop against torch's (eager_vs_torch.py --control), case by case,
# each case its own JSON so that a run cut off keeps what finished. With BASE=<folder holding
# another commit's python/ and shared_specs/>, the cases named in BASE_CASES also run
# against that commit, right after the same case of this one (same machine, same call).
#
# On the device machine, from the repository root:
#   AMPKIT_GIT_COMMIT=<sha> [BASE=dir BASE_CASES="seed_mlp convnet"] \
#     bash benchmarks/gpu/eager_scaler_check.sh "$OUT" [repeats (21)] [cases]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: eager_scaler_check.sh OUT [repeats] [cases]}
reps=${2:-21}
cases=${3:-seed_mlp convnet transformer text_classifier}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
  echo "commit: ${AMPKIT_GIT_COMMIT:-unknown}; base: ${BASE:-none} (${BASE_COMMIT:-?}) for ${BASE_CASES:-no case}"
} | tee "$out/card.txt"
start=$(date +%s)
PYTHONPATH=$PWD/python timeout "${TEST_LIMIT:-120}" python3 -m pytest -q -m cuda tests/python \
  -k "scaler or train_step" -p no:cacheprovider > "$out/cuda_tests.log" 2>&1
echo "cuda tests: rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$out/cuda_tests.log"
for case in $cases; do
  for which in branch base; do
    if [ "$which" = base ]; then
      [ -n "${BASE:-}" ] && [[ " ${BASE_CASES:-} " == *" $case "* ]] || continue
      path=$BASE/python
    else
      path=$PWD/python
    fi
    t0=$(date +%s)
    PYTHONPATH=$path python3 benchmarks/gpu/eager_vs_torch.py --profile "${PROFILE:-full}" --repeats "$reps" \
      --control --cases "$case" --json "$out/eager_vs_torch-$case-$which.json" > "$out/$case-$which.log" 2>&1
    echo "$which ($path), $(( $(date +%s) - t0 )) s: $(tail -1 "$out/$case-$which.log")"
  done
done | tee "$out/eager_vs_torch.log"
