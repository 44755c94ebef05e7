#!/usr/bin/env bash
# The GPU tier: GPU tests, the demo and the benchmarks, with a short report.
#
#   bash launch/gpu_tier.sh [STEP ...]   steps: env demo comm layer (the default: one device
#                                        call, at most 560 s), and tests, dist, experts (one
#                                        call each: 540, 300 and 600 s at most)
#
# Writes $OUT/report.md (a summary line per step), $OUT/*.json (benchmark records) and
# $OUT/logs.tgz (every step's full log); without $OUT, writes under ./results/gpu.
# Each step runs even if an earlier one failed; the exit code says whether all passed.
# A device call may last 600 s: the default steps' limits add up to less.
set -uo pipefail
cd "$(dirname "$0")/.."
source launch/gpu_env.sh
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env demo comm layer)
REPORT="$OUT/report.md"
echo "# GPU tier $(date -u +%FT%TZ) on $(hostname), $NGPU GPU(s)" >"$REPORT"
status=0

step() {  # step NAME TIMEOUT_S COMMAND...: run, log, and add a line to the report
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$LOGS/$name.log"
    timeout "$limit" "$@" >>"$LOGS/$name.log" 2>&1
    local rc=$?
    local tail_line
    tail_line=$(grep -E "passed|failed|error|Error|tokens/s|relative error" "$LOGS/$name.log" | tail -n 3 | tr '\n' ' ')
    printf -- "- %s: rc=%s in %ss — %s\n" "$name" "$rc" "$((SECONDS - t0))" "$tail_line" | tee -a "$REPORT"
    [ "$rc" -ne 0 ] && status=1
    return 0
}

for s in "${STEPS[@]}"; do
    case $s in
    env)
        step env 40 bash -c 'set -e; nvidia-smi; nvidia-smi topo -m; python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"'
        ;;
    tests)
        step tests_gpu 540 env EPMOE_TEST_DEVICE=cuda python3 -m pytest -q tests/gpu -p no:cacheprovider
        ;;
    dist)
        step tests_dist 300 env EPMOE_TEST_DEVICE=cuda python3 -m pytest -q tests/distributed -p no:cacheprovider
        ;;
    demo)
        step demo 140 python3 launch/demo.py --nproc "$NGPU" --hidden-size 1024 --intermediate-size 512 --num-experts 64 --top-k 6 --max-batch 512 --steps 40
        ;;
    comm)
        step comm 180 python3 launch/run.py --nproc "$NGPU" -m epmoe.bench comm --tokens 1 128 512 --out "$OUT/comm.json"
        ;;
    experts)  # the kernels' own one-GPU script (tests, tiling sweep, baselines), alone in a call
        step experts 590 bash -c 'KOUT=$(mktemp -d); OUT=$KOUT bash launch/gpu_kernels.sh; rc=$?; for f in summary.txt bench.json tuned_configs.json logs.tar.gz; do cp "$KOUT/$f" "$0/kernels_$f" || rc=1; done; rm -rf "$KOUT"; exit $rc' "$OUT"
        ;;
    layer)
        step layer 200 python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer --out "$OUT/layer.json"
        ;;
    *) echo "unknown step $s" | tee -a "$REPORT"; status=1 ;;
    esac
done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
cat "$REPORT"
exit $status
