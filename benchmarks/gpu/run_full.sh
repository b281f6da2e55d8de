#!/bin/bash
# The full benchmark profile on a GPU, from Python and from R (the published numbers).
#
# On the device machine, from the repository root (the lead's call; see docs/bench.md):
#   bash benchmarks/gpu/run_full.sh "$OUT/gpu"
# with .device-carry/ holding r-runtime.tar.xz and run-r.sh (../shared/tools/r-on-device), and
# optionally rlib-new/ampkit (R CMD INSTALL -l .device-carry/rlib-new r/ampkit here: used as it is).
# Writes raw-<language>-<case>.json, results.json, report.md (and report.png where
# matplotlib is installed), run.log and r-install.log under the folder given (default
# benchmarks/results/gpu), and the whole folder as <folder>.tar.gz beside it.
# Extra arguments go to benchmarks/run.py (e.g. --repeats 5, --cases seed_mlp).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/results/gpu}; shift || true
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible")'
python3 -c 'import yaml' || { echo "PyYAML is missing: carry its wheel (.whl, see the device README)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
mkdir -p "$out"
# The device returns at most 8 files a call, and this folder holds more: the whole
# folder also goes into one archive beside it, written on any exit (a failed or
# interrupted run included). Back here: tar xzf gpu.tar.gz, then
#   python benchmarks/report.py gpu/results.json --out-dir gpu   (report.md and the PNG again)
archive() {
  tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" \
    && echo "archive: $out.tar.gz ($(du -h "$out.tar.gz" | cut -f1))"
}
trap archive EXIT
trap 'exit 143' TERM INT
runtime=.device-carry/r-runtime.tar.xz
langs=python,r
if [ -f "$runtime" ] && [ -f .device-carry/run-r.sh ]; then
  mkdir -p /tmp/rlib
  if [ -d .device-carry/rlib-new/ampkit ]; then  # installed here beforehand: no compiler needed there
    rm -rf /tmp/rlib/ampkit && cp -a .device-carry/rlib-new/ampkit /tmp/rlib/ \
      && echo "R package: installed beforehand (.device-carry/rlib-new)" > "$out/r-install.log"
  else
    bash .device-carry/run-r.sh "$runtime" -- R CMD INSTALL --no-multiarch -l /tmp/rlib r/ampkit > "$out/r-install.log" 2>&1 \
      || { echo "R CMD INSTALL failed:"; tail -20 "$out/r-install.log"; }
  fi
  export R_LIBS=/tmp/rlib
else
  echo "no .device-carry/r-runtime.tar.xz: the R runs are recorded as failed (see docs/bench.md)"
fi
start=$(date +%s)
python3 benchmarks/run.py --profile full --device cuda --langs "$langs" --out "$out" \
  --rscript "bash .device-carry/run-r.sh $runtime" "$@" 2>&1 | tee "$out/run.log"
echo "full profile: $(( $(date +%s) - start )) s of wall time" | tee -a "$out/run.log"
