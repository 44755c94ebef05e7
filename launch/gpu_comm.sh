#!/usr/bin/env bash
# The symm_ll GPU run in one call: comm benchmark (symm_ll, all_to_all, NCCL, peer-store
# ceiling; eager and CUDA graph), the DeepSeek-V3-shaped layer benchmark, and the symm_ll
# and graph-decode GPU tests. Writes $OUT/{comm,layer}.json, $OUT/*.log and a summary.
#
#   OUT=results/gpu bash launch/gpu_comm.sh [STEP ...]   steps: comm layer tests (default all)
set -uo pipefail
cd "$(dirname "$0")/.."
source launch/gpu_env.sh
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(comm layer tests)
status=0
for s in "${STEPS[@]}"; do
    t0=$SECONDS
    case $s in
    comm)
        timeout "${COMM_LIMIT_S:-140}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench comm \
            --tokens 1 128 512 --backends symm_ll:expert_batched all_to_all:standard \
            --iters 20 --warmup 5 --out "$OUT/comm.json" >"$OUT/comm.log" 2>&1
        ;;
    layer)
        timeout "${LAYER_LIMIT_S:-100}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
            --parts layer --tokens 128 --max-num-tokens 128 --experts triton \
            --backends all_to_all symm_ll --iters 10 --out "$OUT/layer.json" >"$OUT/layer.log" 2>&1
        ;;
    tests)
        EPMOE_TEST_DEVICE=cuda timeout "${TESTS_LIMIT_S:-180}" python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_symm_ll.py tests/gpu/test_layer_graph.py >"$OUT/tests.log" 2>&1
        ;;
    *) echo "unknown step $s"; status=1; continue ;;
    esac
    rc=$?
    [ "$rc" -ne 0 ] && status=1
    echo "== $s: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
done
for s in "${STEPS[@]}"; do
    [ -f "$OUT/$s.log" ] && { echo "--- $s"; grep -vE "Warning|warn\(|^W1|OMP_NUM|\*\*\*\*" "$OUT/$s.log" | tail -n 40; }
done
exit $status
