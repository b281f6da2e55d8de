#!/bin/bash
# Issue 27 on the benchmark's own cases, in device calls of under 10 minutes each:
#
#   bash benchmarks/gpu/fp8_cases.sh runner "$OUT"    # speed: the runner's fp8 variants, one case at a time
#   bash benchmarks/gpu/fp8_cases.sh fidelity "$OUT"  # fidelity: every precision of seed_mlp, text_classifier,
#                                                     # convnet (their own batches) and transformer (the stream)
#   bash benchmarks/gpu/fp8_cases.sh fidelity-gpt2 "$OUT"   # gpt2_small (the stream), one process a variant
#   JOBS="CASE DATA VARIANT;..." bash benchmarks/gpu/fp8_cases.sh jobs "$OUT"   # the fidelity jobs named
#   SPEED="ARGS;ARGS" bash benchmarks/gpu/fp8_cases.sh speed "$OUT"   # benchmarks/gpu/fp8_speed.py runs, in turn
#   (DEADLINE_S: the fidelity modes' deadline, default 565 s; POOL: processes at once, default 6;
#    FID_ARGS: fidelity.py's run arguments, default "--device cuda --profile full --steps 500 --seeds 3")
#
# The results file lies in the archive (all.tar.gz: the device returns at most 8 files) beside
# card.txt, which also lists each step's exit status; call 1 of
# benchmarks/results/gpu/fp8-cases-h200-553a544 took 429 s, the fidelity pool its full deadline.
#
# runner: `benchmarks/run.py --profile full --langs python` on transformer, gpt2_small,
# text_classifier and seed_mlp with torch_compile_bf16 (bf16 + compile), ampkit_fp8 and
# ampkit_fp8_auto, interleaved (the runner's GPU default), one process per case; then, if the
# call's time allows, torchao's two recipes on transformer (RUNNER_TORCHAO=0 leaves them out).
# convnet is not run: its only nn.Linear is the head, which every fp8 variant keeps in bf16.
#
# fidelity: `benchmarks/fidelity.py --profile full --steps 500 --seeds 3`, one process per
# case and variant (its own reference), six side by side on the one GPU: nothing is timed, so
# processes sharing the card change how long a curve takes, not its losses, and the fp8
# variants' compilations (one per seed) run on the CPU cores in parallel; a process the
# call's deadline stops loses only its own curves. fp32 for the small cases; fp32_tf32 for
# the token cases, whose plain float32 steps would not fit a call. Here, `python
# benchmarks/fidelity.py --from DIR/fid-*/results.json --reference ampkit_bf16 --out DIR2`
# joins the folders and compares every variant with the reference named.
#
# Needs: the torchao wheel in .whl/ (runner only; carry .whl), AMPKIT_GIT_COMMIT set by the
# caller (the device's tree has no .git). Each step has its own time limit, so that whatever
# finished comes back inside the call's.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:?runner, fidelity, fidelity-gpt2, jobs or speed}
dest=${2:-${OUT:?give an output folder}}
mkdir -p "$dest"
# the device returns at most 8 files: everything but the card is packed into one archive at the end
final=$dest; dest=$(mktemp -d); trap 'tar czf "$final/all.tar.gz" -C "$dest" . && cp "$dest/card.txt" "$final/"; ls -la "$final"' EXIT
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
  nproc | sed 's/^/cpu cores: /'
  echo "commit: ${AMPKIT_GIT_COMMIT:-unknown}"; } | tee "$dest/card.txt"

deadline=$(( $(date +%s) + ${DEADLINE_S:-565} )) FID_ARGS=${FID_ARGS:-}
fid() {  # fid CASE DATA VARIANT: one variant's 3 seeds x 500 steps, a process of its own, its own folder
    local name=fid-$1-$3
    timeout $(( deadline - $(date +%s) )) python3 benchmarks/fidelity.py ${FID_ARGS:---device cuda --profile full --steps 500 --seeds 3} \
        --cases "$1" --data "$2" --reference "$3" --variants "$3" --out "$dest/$name" > "$dest/$name.txt" 2>&1
    echo "fidelity $name: exit $? at $(date +%T)" | tee -a "$dest/card.txt"
}
pool() {  # run the jobs "CASE DATA VARIANT" from stdin, $1 at a time, the longest first
    export -f fid; export dest deadline FID_ARGS
    xargs -P "$1" -L 1 bash -c 'fid "$@"' _
}

case $mode in
runner)
    python3 -m pip install -q --no-deps .whl/torchao-*.whl 2>&1 | tail -2
    python3 -c 'import torchao; print("torchao", torchao.__version__)' | tee -a "$dest/card.txt"
    # limits from fp8_speed.py's compile times at these sizes (20-60 s an arm on a cold cache)
    for spec in transformer:170 gpt2_small:170 text_classifier:200 seed_mlp:90; do
        c=${spec%%:*}
        timeout "${spec##*:}" python3 benchmarks/run.py --device cuda --profile full --langs python --cases "$c" \
            --variants torch_compile_bf16,ampkit_fp8,ampkit_fp8_auto --out "$dest/py-$c" > "$dest/py-$c.txt" 2>&1
        echo "runner $c: exit $? after ${SECONDS}s" | tee -a "$dest/card.txt"
    done
    if [ "${RUNNER_TORCHAO:-1}" = 1 ] && [ "$SECONDS" -lt 420 ]; then
        timeout $((570 - SECONDS)) python3 benchmarks/run.py --device cuda --profile full --langs python \
            --cases transformer --variants torch_compile_bf16,ampkit_fp8,torchao_float8,torchao_float8_rowwise \
            --out "$dest/py-transformer-torchao" > "$dest/py-transformer-torchao.txt" 2>&1
        echo "runner transformer torchao: exit $? after ${SECONDS}s" | tee -a "$dest/card.txt"
    fi
    ;;
fidelity)
    pool 6 <<'JOBS'
transformer stream fp32_tf32
text_classifier case fp32
transformer stream ampkit_fp8
transformer stream ampkit_fp8_auto
text_classifier case ampkit_fp8
text_classifier case ampkit_fp8_auto
transformer stream ampkit_bf16
transformer stream torch_amp
transformer stream ampkit_amp
text_classifier case ampkit_bf16
text_classifier case torch_amp
text_classifier case ampkit_amp
convnet case fp32
seed_mlp case ampkit_fp8
seed_mlp case ampkit_fp8_auto
convnet case ampkit_bf16
convnet case torch_amp
convnet case ampkit_amp
seed_mlp case fp32
seed_mlp case ampkit_bf16
seed_mlp case torch_amp
seed_mlp case ampkit_amp
JOBS
    ;;
fidelity-gpt2)
    pool 6 <<'JOBS'
gpt2_small stream fp32_tf32
gpt2_small stream ampkit_fp8
gpt2_small stream ampkit_fp8_auto
gpt2_small stream ampkit_bf16
gpt2_small stream torch_amp
gpt2_small stream ampkit_amp
JOBS
    ;;
speed)  # benchmarks/gpu/fp8_speed.py runs, one after another under the deadline: $SPEED, each run's
        # arguments separated by ';' (e.g. "--shapes seed_mlp --breakdown --arms bf16_compile,ampkit_fp8_auto")
    python3 -m pip install -q --no-deps .whl/torchao-*.whl 2>&1 | tail -2
    i=0
    while IFS= read -r args; do
        i=$((i + 1))
        timeout $(( deadline - $(date +%s) )) python3 benchmarks/gpu/fp8_speed.py $args --out "$dest/speed-$i.json" \
            > "$dest/speed-$i.txt" 2>&1
        echo "speed $i ($args): exit $? after ${SECONDS}s" | tee -a "$dest/card.txt"
    done < <(tr ';' '\n' <<< "${SPEED:?set SPEED}" | sed '/^ *$/d')
    ;;
jobs)  # the jobs given in $JOBS, "CASE DATA VARIANT" separated by ';' (e.g. those a deadline stopped)
    tr ';' '\n' <<< "${JOBS:?set JOBS}" | sed '/^ *$/d' | pool "${POOL:-6}"
    ;;
*) echo "unknown mode $mode: runner, fidelity, fidelity-gpt2, jobs or speed" >&2; exit 2 ;;
esac
