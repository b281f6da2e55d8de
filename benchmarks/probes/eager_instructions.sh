#!/bin/bash
# Instructions per step of the hand-written loop and the eager train step, and what the step
# adds, by callgrind (needs valgrind and its headers, and a C compiler). See
# eager_instructions.py.   benchmarks/probes/eager_instructions.sh [CASES] [K]
set -euo pipefail
cases=${1:-seed_mlp,convnet}; k=${2:-20}
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
  --callgrind-out-file="$work/cg.out" "$py" benchmarks/probes/eager_instructions.py "$work/ctl.so" "$cases" "$k" >/dev/null 2>&1
for f in $(ls "$work"/cg.out.* | sort -t. -k3 -n); do
  echo "$(grep -m1 '^desc: Trigger' "$f" | sed 's/.*Client Request: //') $(grep -m1 '^summary:' "$f" | awk '{print $2}')"
done | awk -v k="$k" '{split($1, a, "-"); v[a[1] "," a[2]] += $2; n[a[1] "," a[2]]++}
  END {for (c in v) {split(c, b, ","); if (b[2] == "hand") {h = v[c] / n[c] / k; e = v[b[1] ",eager"] / n[b[1] ",eager"] / k;
       printf "%-16s hand %8.1fK  eager %8.1fK  added %7.1fK instructions a step\n", b[1], h / 1e3, e / 1e3, (e - h) / 1e3}}}'
