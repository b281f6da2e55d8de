#!/bin/bash
# The R hand-written loop before and after a change, on the GPU, in one device call:
# the benchmark's runners (Python once a round, R from each tree) on the cases given,
# rounds interleaved, then the medians, R / Python ratios and peak memory
# (benchmarks/gpu/r_loop_summary.py), a probe of what the garbage watch's CUDA memory
# reading costs, and the seed's loop from R against its Python twin (new tree only).
# On seed_mlp the working tree also runs with options(ampkit.defer_update = FALSE)
# ("nodefer"), to show what deferring the scaler's update saves.
#
#   bash benchmarks/gpu/r_loop_compare.sh "$OUT"     (carry: .device-carry)
#
# Needs .device-carry/ with r-runtime.tar.xz and run-r.sh, and the base tree in
# .device-carry/base/ (its python/ and r/ampkit/: git archive <base> python r/ampkit).
# A tree's R package installed here beforehand in .device-carry/rlib-<base|new>/ (R CMD
# INSTALL -l) is used as it is: the package's compiled code (src/) then needs no compiler
# on the device. Without it, the package is installed there from the tree.
# Environment: CASES (seed_mlp,convnet), VARIANTS (fp32_tf32,torch_amp,ampkit_amp,
# ampkit_autocast_only), ROUNDS (2), REPEATS (7), SEED_LOOP (1: run the seed loop too),
# SEED_REPEATS (3: the seed loop's interleaved repeats), NODEFER (0: 1 adds the "nodefer" runs), TREES ("base new"; "new" runs no base tree), SPLIT (1: benchmarks/gpu/r_step_split.R, where the R
# step's time goes, new tree only).
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${1:?give an output folder}
mkdir -p "$dest"
root=$PWD
cases=${CASES:-seed_mlp,convnet}
variants=${VARIANTS:-fp32_tf32,torch_amp,ampkit_amp,ampkit_autocast_only}
rounds=${ROUNDS:-2}
repeats=${REPEATS:-7}
trees=${TREES:-base new}  # TREES=new: the working tree only (no base tree to carry)
runtime=$root/.device-carry/r-runtime.tar.xz
runr() { bash "$root/.device-carry/run-r.sh" "$runtime" "$@"; }
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
  echo "commit: ${AMPKIT_GIT_COMMIT:-unknown}; base: ${AMPKIT_BASE_COMMIT:-unknown}"
  echo "cases $cases; variants $variants; rounds $rounds; repeats $repeats"; } | tee "$dest/card.txt"

declare -A tree=([base]=$root/.device-carry/base [new]=$root)
for t in $trees; do
  rm -rf /tmp/rlib-$t; mkdir -p /tmp/rlib-$t
  if [ -d "$root/.device-carry/rlib-$t/ampkit" ]; then
    cp -a "$root/.device-carry/rlib-$t/ampkit" /tmp/rlib-$t/ && echo "R package ($t): installed beforehand" > "$dest/r-install-$t.log"
  else
    runr -- R CMD INSTALL --no-multiarch -l /tmp/rlib-$t "${tree[$t]}/r/ampkit" > "$dest/r-install-$t.log" 2>&1 \
      || { echo "R CMD INSTALL ($t) failed"; tail -5 "$dest/r-install-$t.log"; }
  fi
done
# Whether the new tree's compiled crossing loads here (its status, or why not).
(export PYTHONPATH=$root/python R_LIBS=/tmp/rlib-new
 runr -e 'suppressMessages(library(ampkit)); invisible(ampkit_available()); s <- ampkit:::crossing_status(); cat("compiled crossing (new):", if (s$on) "in use" else paste("not in use:", s$why), "\n")') 2>&1 \
  | tail -1 | tee -a "$dest/card.txt"

# What reading the CUDA memory allocated costs (the garbage watch's reading).
PYTHONPATH=$root/python python3 - <<'PY' 2>&1 | tee "$dest/memory_reading.txt"
import time, torch
from ampkit import r_bridge
x = torch.randn(1024, 1024, device="cuda"); torch.cuda.synchronize()
def per_call(f, n=20000):
    f(); t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e6
print(f"r_bridge.memory_allocated(): {per_call(r_bridge.memory_allocated):.2f} us a call")
print(f"torch.cuda.memory_allocated(): {per_call(torch.cuda.memory_allocated):.2f} us a call")
PY

nodefer_profile=$(mktemp); echo 'options(ampkit.defer_update = FALSE)' > "$nodefer_profile"
for r in $(seq "$rounds"); do
  IFS=, read -ra cs <<< "$cases"
  for c in "${cs[@]}"; do
    PYTHONPATH=$root/python python3 -m ampkit.bench --profile full --device cuda --seed 0 --cases "$c" \
      --variants "$variants" --repeats "$repeats" --out "$dest/raw-python-$c-r$r.json" > "$dest/log-python-$c-r$r.txt" 2>&1
    # nodefer: the working tree with options(ampkit.defer_update = FALSE), on seed_mlp
    for t in $trees nodefer; do
      [ "$t" = nodefer ] && { [ "$c" != seed_mlp ] || [ "${NODEFER:-0}" != 1 ]; } && continue
      lib=/tmp/rlib-${t/nodefer/new}
      (export PYTHONPATH=${tree[${t/nodefer/new}]}/python R_LIBS=$lib
       [ "$t" = nodefer ] && export R_PROFILE_USER=$nodefer_profile
       runr "${tree[${t/nodefer/new}]}/benchmarks/run.R" --profile full --device cuda --seed 0 --cases "$c" --variants "$variants" \
         --repeats "$repeats" --out "$dest/raw-r-$t-$c-r$r.json") > "$dest/log-r-$t-$c-r$r.txt" 2>&1
    done
    echo "round $r $c: $(grep -h 'ampkit_amp:' "$dest"/log-*-"$c"-r"$r".txt | tr '\n' ' ')"
  done
done
python3 benchmarks/gpu/r_loop_summary.py "$dest" | tee "$dest/summary.txt"

if [ "${SPLIT:-1}" = 1 ]; then
  (export PYTHONPATH=$root/python R_LIBS=/tmp/rlib-new AMPKIT_REPO=$root
   runr benchmarks/gpu/r_step_split.R 7) > "$dest/step_split.txt" 2>&1
  tail -40 "$dest/step_split.txt"
fi
if [ "${SEED_LOOP:-1}" = 1 ]; then
  (export PYTHONPATH=$root/python R_LIBS=/tmp/rlib-new AMPKIT_REPO=$root AMPKIT_SEED_REPEATS=${SEED_REPEATS:-3}
   runr benchmarks/gpu/r_seed_loop.R seed "$dest/seed") > "$dest/seed_loop.log" 2>&1
  tail -12 "$dest/seed_loop.log"
fi
tar czf "$dest/raw.tar.gz" -C "$dest" $(cd "$dest" && ls raw-*.json log-*.txt r-install-*.log 2>/dev/null) \
  && rm -f "$dest"/raw-*.json "$dest"/log-*.txt "$dest"/r-install-*.log
ls "$dest"
