#!/usr/bin/env bash
# The distributed GPU checks and benchmark in one device call (a two-GPU kind):
#   bash benchmarks/gpu/distributed_all.sh "$OUT"
# 1. the gloo scaler tests on this machine's CPU (tests/python/test_distributed.py);
# 2. distributed_step.py with 1 process (no engine and each engine on one GPU) and with
#    every GPU, for the scaling efficiency; JSON and logs under $1.
set -u
out=${1:?usage: distributed_all.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/cards.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/python/test_distributed.py > "$out/test_distributed.log" 2>&1
  tail -1 "$out/test_distributed.log"
fi
# EXTRA: more distributed_step.py flags for every run (e.g. --bucket-view); the 2-GPU run
# also compares captured and eager steps (--check).
for n in 1 "$ngpu"; do
  check=$([ "$n" -gt 1 ] && echo --check)
  timeout 400 torchrun --standalone --nproc-per-node "$n" benchmarks/gpu/distributed_step.py \
    --case "${CASE:-transformer}" --engines "${ENGINES:-ddp,fsdp2}" --repeats "${REPEATS:-5}" \
    $check ${EXTRA:-} --json "$out/distributed-${n}gpu${TAG:-}.json" > "$out/distributed-${n}gpu${TAG:-}.log" 2>&1
  echo "== $n GPU(s): rc=$?"; grep '^{' "$out/distributed-${n}gpu${TAG:-}.log"
done
