#!/bin/bash
# The seed's loop from R on the GPU device, against its Python twin, in one device call:
#   1. time and peak memory of the seed's three runs (default, autocast, autocast + scaler)
#      from R and from Python, in one process (benchmarks/gpu/r_seed_loop.R seed)
#   2. the largest transformer batch that fits, by bisection, from R, then from Python
#      (each in a fresh process)
# The lead's call (carry: .device-carry, see ../shared/tools/r-on-device/README.md):
#   bash benchmarks/gpu/r_seed_loop.sh "$OUT"
# STEPS="seed bisect" picks steps; the script's environment variables pass through
# (AMPKIT_SEED_SIZES, AMPKIT_SEED_REPEATS, AMPKIT_BISECT_MAX, ...). Without
# .device-carry (a machine with R), RSCRIPT=Rscript runs it with the local R.
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-${OUT:?give an output folder}}
steps=${STEPS:-seed bisect}
mkdir -p "$dest"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 AMPKIT_REPO=$PWD
root=$PWD
if [ -n "${RSCRIPT:-}" ]; then
  runr() { if [ "$1" = "--" ]; then shift; "$@"; else $RSCRIPT "$@"; fi; }
else
  runr() { bash "$root/.device-carry/run-r.sh" "$root/.device-carry/r-runtime.tar.xz" "$@"; }
  mkdir -p /tmp/rlib
  runr -- R CMD INSTALL --no-multiarch -l /tmp/rlib r/ampkit > "$dest/r_install.log" 2>&1 \
    || { echo "R CMD INSTALL failed"; tail -20 "$dest/r_install.log"; exit 1; }
  export R_LIBS=/tmp/rlib
fi
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "commit: ${AMPKIT_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"; } | tee "$dest/card.txt"
has() { [[ " $steps " == *" $1 "* ]]; }
if has seed; then
  runr benchmarks/gpu/r_seed_loop.R seed "$dest" 2>&1 | tee "$dest/seed_loop.log" | tail -12
fi
if has bisect; then
  runr benchmarks/gpu/r_seed_loop.R bisect-r "$dest" > "$dest/bisect_r.log" 2>&1; tail -1 "$dest/bisect_r.log"
  runr benchmarks/gpu/r_seed_loop.R bisect-python "$dest" > "$dest/bisect_python.log" 2>&1; tail -1 "$dest/bisect_python.log"
fi
