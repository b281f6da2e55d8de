#!/bin/bash
# The armed doctor's cost on seed_mlp's eager step, this tree against a base commit's, in one
# device call: doctor_ab.py per step (--per-step 4000: the two copies step one by one in
# turn, host-timed, the ratio of the mean step times), each version twice, then what no
# watch of the output gradient can skip (--floor: torch's module hooks and a Python hook on
# the output's gradient; --floor-retain: the same with retain_grad), the module hooks alone
# (--noop-hooks) and a control (nothing armed). JSON per run under the folder given.
#   bash benchmarks/gpu/doctor_vs_base.sh "$OUT/ab" BASE_PYTHONPATH [BASE_NAME]
# BASE_PYTHONPATH holds the base's ampkit package (e.g. `git archive BASE python/ampkit`
# unpacked into an untracked folder that travels with the tree).
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${1:?give an output folder}; base=${2:?give the base ampkit folder}; name=${3:-base}
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
P=${AB_ARGS:---per-step 4000}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
  echo "commit: ${AMPKIT_GIT_COMMIT:-unknown}; base: $name"; } | tee "$dest/card.txt"
{
for i in 1 2; do
  echo -n "$name: "; PYTHONPATH=$base python3 benchmarks/probes/doctor_ab.py $P --json "$dest/base-$i.json"
  echo -n "this tree: "; PYTHONPATH=$PWD/python python3 benchmarks/probes/doctor_ab.py $P --json "$dest/tree-$i.json"
done
for f in floor floor-retain noop-hooks control; do
  PYTHONPATH=$PWD/python python3 benchmarks/probes/doctor_ab.py --$f $P --json "$dest/$f.json"
done
} 2>&1 | tee "$dest/summary.txt"
