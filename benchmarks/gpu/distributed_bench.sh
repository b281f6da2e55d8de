#!/usr/bin/env bash
# The multi-GPU benchmark in one device call on a two-GPU kind (nvidia-h100-x2):
#   bash benchmarks/gpu/distributed_bench.sh "$OUT"
# benchmarks/run.py --gpus 2 on the full profile: the transformer, text_classifier and
# gpt2_small cases, DDP and FSDP2, torch_amp / ampkit_amp / ampkit_step, with 1 and 2
# processes (for the scaling efficiency), and make_train_step captured against eager with
# 2 (--check).
# DDP runs in four configurations, every variant alike in each:
#   default | gradient_as_bucket_view | + static_graph | + bucket_cap_mb=100
# The three variants of each case and engine configuration are timed interleaved: built
# and warmed up together, then REPEATS rounds of one 20-step epoch each, the order rotating,
# so that ampkit_step / torch_amp compares epochs of the same minutes (SEQUENTIAL=1: each
# variant alone, its epochs in a row, as before). A piece of a run (a build, a warm-up, an
# epoch) that stalls is stopped after RUN_TIMEOUT seconds (its stack goes to the launch
# log) and its group recorded as failed; the runs not started within BUDGET seconds are
# recorded as skipped. Writes into $1 (at most 8 files): results.json, report.md, run.log,
# cards.txt and dist.tar.gz (everything, the launch logs and events included), on any exit.
# Environment: CASES (comma-separated; default transformer,text_classifier,gpt2_small),
# BUDGET (default 380 s of runs), RUN_TIMEOUT (90 s), REPEATS (rounds; default the
# profile's 3; each round of the transformer and text_classifier adds about 40 s on two
# H100s, both process counts together), SEQUENTIAL=1, TESTS=1 to run the gloo scaler tests
# first (about 30 s), EXTRA (more run.py flags).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: distributed_bench.sh OUT_DIR}
mkdir -p "$out"
work=$(mktemp -d)/dist
mkdir -p "$work"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
archive() {
  tar -czf "$out/dist.tar.gz" -C "$(dirname "$work")" dist
  cp "$work/results.json" "$work/report.md" "$out/" 2>/dev/null
  echo "archive: $out/dist.tar.gz ($(du -h "$out/dist.tar.gz" | cut -f1))"
}
trap archive EXIT
trap 'exit 143' TERM INT
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/cards.txt"
if [ -n "${TESTS:-}" ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/python/test_distributed.py > "$work/test_distributed.log" 2>&1
  echo "gloo scaler tests: $(tail -1 "$work/test_distributed.log")"
fi
repeats=${REPEATS:+--repeats $REPEATS}
sequential=${SEQUENTIAL:+--sequential}
python3 benchmarks/run.py --gpus 2 --device cuda --profile full --out "$work" \
  --cases "${CASES:-transformer,text_classifier,gpt2_small}" --engines ddp,fsdp2 \
  --ddp-options default \
  --ddp-options gradient_as_bucket_view=true \
  --ddp-options gradient_as_bucket_view=true,static_graph=true \
  --ddp-options gradient_as_bucket_view=true,bucket_cap_mb=100 \
  --check --run-timeout "${RUN_TIMEOUT:-90}" --budget "${BUDGET:-380}" $repeats $sequential ${EXTRA:-} 2>&1 | tee "$out/run.log"
echo "distributed_bench: $(( $(date +%s) - start )) s of wall time" | tee -a "$out/run.log"
