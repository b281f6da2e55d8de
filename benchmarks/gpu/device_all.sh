#!/bin/bash
# Everything the GPU machine is needed for, in one device call (device time is scarce):
#   1. the CUDA-marked pytest suite (autocast tables fp16/bf16, scaler, train step)
#   2. the CUDA drift check of the shipped policy, fp16 and bf16
#   3. the R package on the GPU: its testthat suite, and the R seed walkthrough verbatim
#   4. the scaler proof (no sync, captured skip, steps/s) and the train-step benchmark
#   5. the full benchmark profile from Python and R (benchmarks/gpu/run_full.sh)
#   6. eager: torch_amp, ampkit_amp and a one-op override interleaved in one process
#      (benchmarks/gpu/eager_vs_torch.py, full profile, EAGER_ARGS, default --repeats 11)
#   7. doctor: the numerics doctor's overhead, no-sync check and repair (doctor_gpu.py)
# Logs are written to a work folder and packed into one all.tar.gz in the folder given
# (default $OUT), with the benchmark report beside it: the device returns at most 8 files.
#
# Needs .device-carry/ with r-runtime.tar.xz and run-r.sh (../shared/tools/r-on-device).
# The lead's call:  bash benchmarks/gpu/device_all.sh "$OUT"   (carry: .device-carry)
# Steps can be chosen: STEPS="pytest drift r seed proof stepbench bench eager doctor" (default: all);
# STEPBENCH_ARGS go to train_step_bench.py (default --repeats 5), BENCH_ARGS to
# run_full.sh (e.g. "--cases transformer").
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-${OUT:?give an output folder}}
out=$(mktemp -d)
steps=${STEPS:-pytest drift r seed proof stepbench bench eager doctor}
mkdir -p "$dest"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
root=$PWD
runr() { bash "$root/.device-carry/run-r.sh" "$root/.device-carry/r-runtime.tar.xz" "$@"; }
has() { [[ " $steps " == *" $1 "* ]]; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
  # The device's copy of the tree may carry a stale .git: the caller's AMPKIT_GIT_COMMIT wins.
  echo "commit: ${AMPKIT_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"; } | tee "$out/card.txt"
# Whatever ran comes back, also when a step fails or the call's time limit stops the script.
pack() { tar czf "$dest/all.tar.gz" -C "$out" .; cp "$out/card.txt" "$dest/"
         [ -f "$out/bench/report.md" ] && cp "$out/bench/report.md" "$dest/"; ls -la "$dest"; }
trap pack EXIT
trap 'exit 143' TERM INT

if has pytest; then
  # hypothesis is not installed on the device: the property tests stay on the CPU.
  python3 -m pytest -q -p no:cacheprovider -m cuda tests/python \
    --ignore=tests/python/test_scaler_property.py --ignore=tests/python/test_bench_r.py \
    > "$out/pytest_cuda.log" 2>&1
  echo "pytest -m cuda: rc=$? $(tail -1 "$out/pytest_cuda.log")"
fi
if has drift; then
  for d in float16 bfloat16; do
    python3 -m ampkit.drift check --device cuda --dtype $d > "$out/drift_cuda_$d.txt" 2>&1
    echo "drift check cuda $d: rc=$? $(sed -n 2p "$out/drift_cuda_$d.txt")"
  done
fi
if has r || has seed; then
  mkdir -p /tmp/rlib
  runr -- R CMD INSTALL --no-multiarch -l /tmp/rlib r/ampkit > "$out/r_install.log" 2>&1 \
    || { echo "R CMD INSTALL failed"; tail -20 "$out/r_install.log"; }
  export R_LIBS=/tmp/rlib AMPKIT_REPO=$PWD
fi
if has r; then
  (cd r/ampkit/tests && runr -e 'testthat::test_dir("testthat", package = "ampkit", load_package = "installed", stop_on_failure = TRUE)') \
    > "$out/r_testthat_cuda.log" 2>&1
  echo "R testthat on the GPU: rc=$? $(grep -E '\[ FAIL' "$out/r_testthat_cuda.log" | tail -1)"
fi
if has seed; then
  # The R seed (shared/seeds/002) as written, library(ampkit) in place of library(torch).
  runr r/ampkit/tests/testthat/fixtures/seed-walkthrough.R > "$out/r_seed_verbatim.log" 2>&1
  echo "R seed walkthrough verbatim: rc=$?"; grep -A2 "user" "$out/r_seed_verbatim.log"
fi
if has proof; then
  OUT=$out python3 benchmarks/gpu/scaler_proof.py > "$out/scaler_proof.log" 2>&1
  echo "scaler proof: rc=$?"; tail -30 "$out/scaler_proof.log"
fi
if has stepbench; then
  OUT=$out python3 benchmarks/gpu/train_step_bench.py ${STEPBENCH_ARGS:---repeats 5} > "$out/train_step_bench.log" 2>&1
  echo "train step bench: rc=$?"; grep -v ' \.\.\.$' "$out/train_step_bench.log" | tail -60
fi
if has bench; then
  bash benchmarks/gpu/run_full.sh "$out/bench" ${BENCH_ARGS:-} 2>&1 | tail -60
fi
if has eager; then
  python3 benchmarks/gpu/eager_vs_torch.py --profile full ${EAGER_ARGS:---repeats 11} \
    --json "$out/eager_vs_torch.json" > "$out/eager_vs_torch.log" 2>&1
  echo "eager vs torch: rc=$?"; tail -8 "$out/eager_vs_torch.log"
fi
if has doctor; then
  if [ -f benchmarks/gpu/doctor_gpu.py ]; then
    python3 benchmarks/gpu/doctor_gpu.py "$out/doctor" > "$out/doctor_gpu.log" 2>&1
    echo "doctor: rc=$?"; tail -30 "$out/doctor_gpu.log"
  else echo "doctor: benchmarks/gpu/doctor_gpu.py is not in this tree"; fi
fi
