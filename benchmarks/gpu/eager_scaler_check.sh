#!/bin/bash
# The eager-speed check of the scaler and region: the CUDA scaler tests (TEST_K),
# then ampkit's eager AMP loop against torch's (eager_vs_torch.py --control), case by case,
# each case its own JSON so that a run cut off keeps what finished. With BASE=<folder holding
# another commit's python/ and shared_specs/>, the cases named in BASE_CASES then run
# against that commit too (same machine, same call).
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
  -k "${TEST_K:-scaler}" -p no:cacheprovider > "$out/cuda_tests.log" 2>&1
echo "cuda tests: rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$out/cuda_tests.log"
run_case() {  # which, python path, case
  local t0=$(date +%s)
  PYTHONPATH=$2 python3 benchmarks/gpu/eager_vs_torch.py --profile "${PROFILE:-full}" --repeats "$reps" \
    --control --cases "$3" --json "$out/eager_vs_torch-$3-$1.json" > "$out/$3-$1.log" 2>&1
  echo "$1 ($2), $(( $(date +%s) - t0 )) s: $(tail -1 "$out/$3-$1.log")"
}
{ for case in $cases; do run_case branch "$PWD/python" "$case"; done
  if [ -n "${BASE:-}" ]; then for case in ${BASE_CASES:-}; do run_case base "$BASE/python" "$case"; done; fi
} | tee "$out/eager_vs_torch.log"
