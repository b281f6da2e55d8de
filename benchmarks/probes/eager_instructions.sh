#!/bin/bash
# Instructions per step of the hand-written loop and the eager train step, and what the step
# adds, by callgrind (needs valgrind and its headers, and a C compiler). See
# eager_instructions.py.   benchmarks/probes/eager_instructions.sh [CASES] [K] [MODES=eager,fallback]
set -euo pipefail
cases=${1:-seed_mlp,convnet}; k=${2:-20}; modes=${3:-eager,fallback}
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat > "$work/ctl.c" <<'C'
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void cg_dump(const char *what) { CALLGRIND_DUMP_STATS_AT(what); }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
C
cc -shared -fPIC -O2 -o "$work/ctl.so" "$work/ctl.c"
cd "$root" && PYTHONHASHSEED=0 OMP_NUM_THREADS=1 valgrind --tool=callgrind --instr-atstart=no \
  --callgrind-out-file="$work/cg.out" "$py" benchmarks/probes/eager_instructions.py "$work/ctl.so" "$cases" "$k" "$modes" >"$work/log" 2>&1 \
  || { grep -v '^==' "$work/log" | tail -20 >&2; exit 1; }
for f in "$work"/cg.out.*; do
  echo "$(grep -m1 '^desc: Trigger' "$f" | sed 's/.*Client Request: //') $(grep -m1 '^summary:' "$f" | awk '{print $2}')"
done | awk -v k="$k" '{split($1, a, "-"); c = a[1] "," a[2]; v[c "," a[3]] += $2; n[c "," a[3]]++; seen[c] = 1}
  END {for (c in seen) {split(c, b, ","); h = v[c ",hand"] / n[c ",hand"] / k; e = v[c ",eager"] / n[c ",eager"] / k;
       printf "%-16s %-9s hand %8.1fK  step %8.1fK  added %7.1fK instructions a step\n", b[1], b[2], h / 1e3, e / 1e3, (e - h) / 1e3}}' | sort -k1,1 -k2,2
