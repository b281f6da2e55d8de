#!/bin/bash
# Issue 26's peak memory, the compiled captured step against reduce-overhead, in one device call:
#
#   AMPKIT_GIT_COMMIT=<sha> bash benchmarks/gpu/step_memory.sh "$OUT"
#
# 1. (TESTS=1, the default) every CUDA test, `pytest -m cuda tests/python`;
# 2. the runner, one process, CASES (default convnet,text_classifier) with VARIANTS (default
#    torch_compile_ro,ampkit_step_compiled), REPEATS rounds (default 5): its peaks (mem.json);
# 3. (CENSUS, default "convnet") the census of each of VARIANTS alone in its own process
#    (benchmarks/gpu/peak_census.py): what is alive at its peak.
# Each step has its own time limit; everything but card.txt is packed into all.tar.gz (the
# device returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-${OUT:?give an output folder}}
mkdir -p "$dest/files"
export PYTHONPATH=$PWD/python
cases=${CASES:-convnet,text_classifier}
variants=${VARIANTS:-torch_compile_ro,ampkit_step_compiled}
card="$dest/card.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$card"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" >> "$card"
echo "commit ${AMPKIT_GIT_COMMIT:-unknown}" >> "$card"
step() {  # step NAME LIMIT_S COMMAND...: its output in files/NAME.txt, its status in the card
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$card"
  timeout "$limit" "$@" > "$dest/files/$name.txt" 2>&1
  echo "   rc=$? in $((SECONDS - t0)) s" | tee -a "$card"
  tail -n 3 "$dest/files/$name.txt"
}
if [ "${TESTS:-1}" = 1 ]; then
  step cuda-tests "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m cuda tests/python
fi
step runner "${RUNNER_S:-240}" python3 -m ampkit.bench --profile full --device cuda --cases "$cases" \
  --variants "$variants" --repeats "${REPEATS:-5}" --out "$dest/files/mem.json"
for case in ${CENSUS-convnet}; do
  step "census-$case" "${CENSUS_S:-150}" python3 benchmarks/gpu/peak_census.py "$case" "$variants" --top 20
done
tar -C "$dest" -czf "$dest/all.tar.gz" files && rm -rf "$dest/files"
