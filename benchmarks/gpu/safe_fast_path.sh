#!/usr/bin/env bash
# Issue 25's GPU evidence in one device call on a two-GPU kind (nvidia-h100-x2):
#   bash benchmarks/gpu/safe_fast_path.sh "$OUT"
# 1. the CUDA tests of the captured step (beside torch.compile and other graphs, 1000
#    rounds a sequence; DDP's defaults; captured against eager) and of the scaler across
#    two GPUs (DDP, FSDP2, FSDP1 in both use_orig_params modes and every strategy), plus
#    the gloo scaler tests on this CUDA build;
# 2. what a DDP or FSDP2 model needs to capture, on two GPUs (ddp_capture_probe.py);
# 3. gpt2_small under DDP with its defaults and under FSDP2, with 1 and 2 processes:
#    torch_amp, ampkit_amp, ampkit_step and ampkit_step_eager timed interleaved, and the
#    captured step checked against eager (--check).
# Writes into $1: cards.txt, tests.log, probe.log, results.json, report.md, run.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: safe_fast_path.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/cards.txt"
python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$out/cards.txt"
start=$(date +%s)
timeout "${TEST_TIMEOUT:-270}" python3 -m pytest -q -rs -p no:cacheprovider -m cuda \
  tests/python/test_train_step_coexist_cuda.py tests/python/test_train_step_ddp.py \
  tests/python/test_train_step_cuda.py tests/python/test_distributed_cuda.py > "$out/tests.log" 2>&1
echo "cuda tests: $(tail -1 "$out/tests.log") ($(( $(date +%s) - start )) s)"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/python/test_distributed.py >> "$out/tests.log" 2>&1
echo "gloo scaler tests: $(tail -1 "$out/tests.log") ($(( $(date +%s) - start )) s)"
timeout 100 python3 benchmarks/gpu/ddp_capture_probe.py --gpus 2 --combos ";side;fsdp2;eager;fsdp2,eager" 2>&1 | tee "$out/probe.log"
echo "probe: $(( $(date +%s) - start )) s"
work=$(mktemp -d)
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/run.py --gpus 2 --device cuda --profile full --out "$work" \
  --cases gpt2_small --engines ddp,fsdp2 --ddp-options default \
  --variants torch_amp,ampkit_amp,ampkit_step,ampkit_step_eager --repeats "${REPEATS:-5}" \
  --check --run-timeout 90 --budget "${BUDGET:-200}" > "$out/run.log" 2>&1
cp "$work/results.json" "$work/report.md" "$out/" 2>/dev/null
grep -A30 -i "across gpus" "$out/report.md" 2>/dev/null | head -40
echo "safe_fast_path: $(( $(date +%s) - start )) s of wall time"
