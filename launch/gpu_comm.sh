#!/usr/bin/env bash
# The symm_ll GPU run in one call: comm benchmark (symm_ll, all_to_all, NCCL, peer-store
# ceiling; eager and CUDA graph, cold and back to back), the DeepSeek-V3-shaped layer
# benchmark, and the symm_ll and graph-decode GPU tests. Writes $OUT/{comm,layer}.json,
# $OUT/*.log and a summary.
#
#   OUT=results/gpu bash launch/gpu_comm.sh [STEP ...]   steps (default: comm layer tests):
#     comm layer tests   as above (tests: symm_ll, the layer in a graph, decode graph buckets,
#                        auto's choices)
#     gpu                every test under tests/gpu (gpu_comm_tests: without the expert
#                        kernels' files, which gpu_kernels.sh runs)
#     dist               the multi-process tests (tests/distributed) on NCCL and CUDA tensors
#     shared             the multi-rank GPU tests (symm_ll, symm_ht, decode graphs, the layer
#                        in a graph) at W = SHARED_RANKS x GPUs, SHARED_RANKS (default 2)
#                        ranks on each GPU (EPMOE_TEST_RANKS_PER_GPU, a gloo group):
#                        correctness where GPUs are fewer than ranks; no timing means
#                        anything there
#     shared_conformance the registry's conformance suite so (DeepEP and pplx skip: they refuse
#                        ranks sharing a GPU)
#     stress             launch/stress.py, 500 calls per configuration (STRESS_BUDGET_S)
#     profile            per-kernel GPU times of symm_ll at 128 tokens (torch.profiler)
#     ht                 symm_ht: its GPU tests, and the comm benchmark at prefill sizes
#                        (every SM and DeepEP's 24, 4 rows per flag and one count per program)
#     ht_variants        symm_ht's streamed combine at 4096 tokens against the sum at wait(),
#                        other reducer counts and chunk sizes, and on DeepEP's 24 SMs
#     conformance        the registry's conformance suite, FP8 weights, shard loading and
#                        bitwise determinism (symm_* with Triton experts too) on NCCL
#     prefill            the layer at 4096 tokens per rank on symm_ht, all_to_all and symm_ll
#                        (chunked), with one and two micro-batches
#     overlap            prefill (4096 tokens) on symm_ht with one and two micro-batches in one
#                        run, and decode with FP8 expert weights
#     eplb               the EPLB placement benchmark and its balancedness plot
#     serving            examples/serving.py on every GPU (symm_ll), eager, with the MoE blocks'
#                        decode graphs and with the whole decode step's: tokens/s, TTFT, ITL
#     crossover          the layer on symm_ll and symm_ht from 128 to 2048 tokens per rank
#     ep_tests ep_comm ep_layer ep_experts
#                        the EP4/EP8 issue's matrix at EP = all GPUs, a call or two for
#                        the four: tests at W = NGPU, comm, layer (bf16 with live EPLB under
#                        skew; FP8 weights and wire), experts
#     dsv3               the serving example on a DeepSeek-V3-shaped FP8 checkpoint written on
#                        the machine: decode batch 128 and prefill 4096 tokens per rank, FP8
#                        experts eager / CUDA graphs / on one GPU, and bf16 experts
#                        (DSV3_RUNS, below)
#     info               python -m epmoe.info (text and --json) on the GPU machine
#     decode_ht          the decode step (128 tokens) on symm_ht's Standard layout beside
#                        symm_ll's ExpertBatched one (rows read in place vs expanded)
#     rows               symm_ll's two receive designs side by side: rows read in place
#                        through an index (default) and rows copied into [e, C, H] slabs;
#                        comm at 1, 128 and 512 tokens, the layer at 128 (bf16 and FP8
#                        expert weights, EPMOE_SYMM_LL_ROWS)
#     timeline           where symm_ll's time goes at 128 tokens: each program's steps on the
#                        GPU timer (python -m epmoe.bench timeline), once per environment in
#                        TIMELINE_VARIANTS (space-separated; commas join several settings)
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
        EPMOE_TEST_DEVICE=cuda timeout "${TESTS_LIMIT_S:-300}" python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_symm_ll.py tests/gpu/test_layer_graph.py tests/gpu/test_decode_graphs.py \
            tests/gpu/test_auto_backends.py \
            >"$OUT/tests.log" 2>&1
        ;;
    gpu)
        EPMOE_TEST_DEVICE=cuda timeout "${GPU_LIMIT_S:-540}" python3 -m pytest -q -p no:cacheprovider \
            tests/gpu >"$OUT/gpu.log" 2>&1
        ;;
    gpu_comm_tests)
        # tests/gpu without the expert kernels' two files (gpu_kernels.sh runs those): what
        # the comm, graph and serving code needs, when all of tests/gpu does not fit a call
        EPMOE_TEST_DEVICE=cuda timeout "${GPU_LIMIT_S:-540}" python3 -m pytest -q -p no:cacheprovider \
            tests/gpu --ignore=tests/gpu/test_triton_experts_gpu.py \
            --ignore=tests/gpu/test_wgmma_kernels.py >"$OUT/gpu_comm_tests.log" 2>&1
        ;;
    shared)
        EPMOE_TEST_DEVICE=cuda EPMOE_TEST_RANKS_PER_GPU=${SHARED_RANKS:-2} \
            EPMOE_TEST_WORLDS=$((${SHARED_RANKS:-2} * NGPU)) \
            timeout "${SHARED_LIMIT_S:-300}" python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_symm_ll.py tests/gpu/test_symm_ht.py tests/gpu/test_decode_graphs.py \
            tests/gpu/test_layer_graph.py >"$OUT/shared.log" 2>&1
        ;;
    shared_conformance)
        # each test's outcome on its own line (-v -rA): what ran is known after a timeout too
        EPMOE_TEST_DEVICE=cuda EPMOE_TEST_RANKS_PER_GPU=${SHARED_RANKS:-2} \
            EPMOE_TEST_WORLDS=$((${SHARED_RANKS:-2} * NGPU)) EPMOE_TEST_TIMEOUT=90 \
            timeout "${SHARED_CONFORMANCE_LIMIT_S:-360}" python3 -m pytest -v -rA --tb=short \
            -p no:cacheprovider tests/distributed/test_comm_v2.py >"$OUT/shared_conformance.log" 2>&1
        ;;
    dist)
        EPMOE_TEST_DEVICE=cuda timeout "${DIST_LIMIT_S:-300}" python3 -m pytest -q -p no:cacheprovider \
            tests/distributed >"$OUT/dist.log" 2>&1
        ;;
    stress)
        timeout "${STRESS_LIMIT_S:-300}" python3 launch/run.py --nproc "$NGPU" launch/stress.py \
            --steps 500 --budget-s "${STRESS_BUDGET_S:-240}" --json "$OUT/stress.json" >"$OUT/stress.log" 2>&1
        ;;
    profile)
        timeout "${PROFILE_LIMIT_S:-120}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench comm \
            --tokens 128 --backends symm_ll:expert_batched --iters 5 --warmup 3 --profile \
            >"$OUT/profile.log" 2>&1
        ;;
    ht)
        EPMOE_TEST_DEVICE=cuda timeout "${HT_TESTS_LIMIT_S:-240}" python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_symm_ht.py tests/gpu/test_symm_ht_one_gpu.py >"$OUT/ht.log" 2>&1
        failed=$?  # (the benchmarks run after a failed test too: they are what the step is for)
        timeout "${HT_BENCH_LIMIT_S:-200}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench comm \
            --tokens 512 4096 16384 --dispatch-dtypes bfloat16 float8_e4m3fn \
            --backends symm_ht:standard symm_ht:standard:66 symm_ht:standard:32 \
            symm_ht:standard:24 symm_ht:standard::4 all_to_all:standard --iters 10 --warmup 3 \
            --out "$OUT/comm_ht.json" >>"$OUT/ht.log" 2>&1 || failed=1
        # symm_ll beside it where its [e, W·M, H] buffers fit (16384 tokens per rank do not)
        timeout "${HT_LL_LIMIT_S:-120}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench comm \
            --tokens 512 4096 --dispatch-dtypes bfloat16 float8_e4m3fn \
            --backends symm_ll:expert_batched --iters 10 --warmup 3 \
            --out "$OUT/comm_ht_ll.json" >>"$OUT/ht.log" 2>&1 || failed=1
        [ "$failed" -eq 0 ]
        ;;
    ht_variants)
        timeout "${HT_VARIANTS_LIMIT_S:-150}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench comm \
            --tokens 4096 --dispatch-dtypes bfloat16 --backends symm_ht:standard \
            symm_ht:standard:reducers=0 symm_ht:standard:reducers=33 symm_ht:standard:reducers=99 \
            symm_ht:standard:combine_chunk=256 symm_ht:standard:combine_chunk=1024 \
            symm_ht:standard:24 symm_ht:standard:num_sms=24,reducers=8 \
            symm_ht:standard:num_sms=24,reducers=12 --iters 10 --warmup 3 \
            --out "$OUT/comm_ht_variants.json" >"$OUT/ht_variants.log" 2>&1
        ;;
    conformance)
        worlds=1,2; [ "$NGPU" -gt 2 ] && worlds="1,2,$NGPU"
        EPMOE_TEST_WORLDS="${EPMOE_TEST_WORLDS:-$worlds}" EPMOE_TEST_DEVICE=cuda timeout "${CONF_LIMIT_S:-300}" python3 -m pytest -q -p no:cacheprovider \
            tests/distributed/test_comm_v2.py tests/distributed/test_fp8_weights.py \
            tests/distributed/test_sharded_load.py \
            "tests/distributed/test_stress.py::test_backends_are_bitwise_deterministic" \
            >"$OUT/conformance.log" 2>&1
        ;;
    overlap)
        timeout "${OVERLAP_LIMIT_S:-240}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
            --parts layer --tokens 4096 --experts triton --backends symm_ht \
            --micro-batches 1 2 --iters 10 --out "$OUT/layer_overlap.json" >"$OUT/overlap.log" 2>&1
        failed=$?
        timeout "${OVERLAP_LIMIT_S:-240}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
            --parts layer --tokens 128 --max-num-tokens 128 --experts triton --backends symm_ll \
            --weight-dtype float8_e4m3fn --iters 10 --out "$OUT/layer_fp8w.json" >>"$OUT/overlap.log" 2>&1 || failed=1
        [ "$failed" -eq 0 ]
        ;;
    prefill)
        # one process per backend, each writing its records (a time limit keeps the first)
        end=$((SECONDS + ${PREFILL_LIMIT_S:-400}))
        : >"$OUT/prefill.log"
        for b in symm_ht all_to_all symm_ll; do
            [ $((end - SECONDS)) -lt 30 ] && { echo "prefill: no time left for $b" >>"$OUT/prefill.log"; continue; }
            timeout $((end - SECONDS)) python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
                --parts layer --tokens 4096 --experts triton --backends "$b" \
                --micro-batches 1 2 --iters 10 --out "$OUT/layer_prefill_$b.json" >>"$OUT/prefill.log" 2>&1
        done
        ;;
    eplb)
        timeout "${EPLB_LIMIT_S:-120}" python3 -m epmoe.bench eplb --out "$OUT/eplb.json" \
            --plot "$OUT/eplb_balancedness.png" >"$OUT/eplb.log" 2>&1
        ;;
    serving)
        failed=0
        for graphs in "" "--cuda-graphs blocks" "--cuda-graphs step"; do
            timeout "${SERVING_LIMIT_S:-150}" python3 launch/run.py --nproc "$NGPU" examples/serving.py \
                --device cuda --backend symm_ll --requests 48 --max-batch 16 --max-new-tokens 32 \
                --hidden-size 1024 --num-experts 16 --top-k 4 $graphs >>"$OUT/serving.log" 2>&1 || failed=1
        done
        [ "$failed" -eq 0 ]
        ;;
    dsv3)
        # a DeepSeek-V3-shaped FP8 checkpoint (4 MoE layers, H 7168, 256 experts, top-8;
        # about 46 GB), written once on the machine's disk (kept while it stays warm), then
        # served. DSV3_RUNS picks the runs (one device call holds two: 150 + 2 x 200 s at most
        # with the write, which took 64 s on 2026-12-01):
        #   fp8 / graphs / blocks: FP8 experts on every GPU, eager / the whole decode step in
        #   a CUDA graph / only the MoE blocks in CUDA graphs;
        #   one / onegraphs: FP8 experts on one GPU holding every expert, eager / step graph;
        #   bf16: dequantised experts
        D="${DSV3_DIR:-/tmp/epmoe-dsv3}"
        failed=0
        [ -f "$D/config.json" ] || timeout "${DSV3_WRITE_S:-150}" python3 \
            examples/deepseek_v3_checkpoint.py "$D" >>"$OUT/dsv3.log" 2>&1 || failed=1
        for run in ${DSV3_RUNS:-fp8 graphs}; do
            case $run in
            fp8) args=("$NGPU" --fp8-experts) ;;
            graphs) args=("$NGPU" --fp8-experts --cuda-graphs step) ;;
            blocks) args=("$NGPU" --fp8-experts --cuda-graphs blocks) ;;
            one) args=(1 --fp8-experts) ;;
            onegraphs) args=(1 --fp8-experts --cuda-graphs step) ;;
            bf16) args=("$NGPU") ;;
            *) echo "unknown DSV3 run $run" >>"$OUT/dsv3.log"; failed=1; continue ;;
            esac
            echo "=== $run: --nproc ${args[*]}" >>"$OUT/dsv3.log"
            timeout "${DSV3_LIMIT_S:-200}" python3 launch/run.py --nproc "${args[0]}" \
                examples/serving.py --device cuda --checkpoint "$D" --requests 256 \
                --max-batch 128 --prefill-chunk 32 --max-prompt 64 --max-new-tokens 16 \
                --check 0 --log-every 50 "${args[@]:1}" >>"$OUT/dsv3.log" 2>&1 || failed=1
        done
        [ "$failed" -eq 0 ]
        ;;
    crossover)
        # the layer between decode and prefill sizes, on symm_ll in one chunk (M 2048) and on
        # symm_ht as auto builds it (M 4096): where auto should switch (now at 256)
        timeout "${CROSSOVER_LIMIT_S:-120}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
            --parts layer --tokens 128 256 512 1024 2048 --max-num-tokens 2048 --experts triton \
            --backends symm_ll --iters 10 --out "$OUT/layer_crossover_ll.json" \
            >"$OUT/crossover.log" 2>&1
        failed=$?
        timeout "${CROSSOVER_LIMIT_S:-120}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
            --parts layer --tokens 128 256 512 1024 2048 --experts triton --backends symm_ht \
            --iters 10 --out "$OUT/layer_crossover_ht.json" >>"$OUT/crossover.log" 2>&1 || failed=1
        [ "$failed" -eq 0 ]
        ;;
    ep_tests)
        # the EP4/EP8 issue's matrix at EP = every GPU of the machine (ep_*): the end-to-end
        # tests at W = NGPU, comm at 128, 512 and 4096 tokens per rank (bf16 and FP8 wire),
        # the layer (bf16 weights with a live EPLB re-plan under skew; FP8 weights and wire),
        # and the experts at this EP's shapes on one GPU (256 / NGPU local experts)
        EPMOE_TEST_WORLDS="$NGPU" EPMOE_TEST_DEVICE=cuda timeout "${EP_TESTS_LIMIT_S:-300}" \
            python3 -m pytest -q -p no:cacheprovider tests/distributed/test_layer.py \
            tests/distributed/test_eplb_live.py tests/gpu/test_layer_graph.py \
            tests/gpu/test_symm_ll.py tests/gpu/test_symm_ht.py >"$OUT/ep_tests.log" 2>&1
        ;;
    ep_comm)
        timeout "${EP_COMM_LIMIT_S:-240}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench comm \
            --tokens 128 512 4096 --backends symm_ll:expert_batched symm_ht:standard \
            all_to_all:standard --iters 10 --warmup 3 --out "$OUT/comm_ep$NGPU.json" \
            >"$OUT/ep_comm.log" 2>&1
        ;;
    ep_layer)
        timeout "${EP_LAYER_LIMIT_S:-280}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
            --tokens 128 512 4096 --experts triton --backends all_to_all symm_ll symm_ht \
            --hot contiguous --out "$OUT/layer_ep$NGPU.json" >"$OUT/ep_layer.log" 2>&1
        failed=$?
        timeout "${EP_LAYER_LIMIT_S:-280}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
            --parts layer --tokens 128 512 4096 --experts triton --backends symm_ll symm_ht \
            --weight-dtype float8_e4m3fn --dispatch-dtype float8_e4m3fn \
            --out "$OUT/layer_ep${NGPU}_fp8.json" >>"$OUT/ep_layer.log" 2>&1 || failed=1
        [ "$failed" -eq 0 ]
        ;;
    ep_experts)
        timeout "${EP_EXPERTS_LIMIT_S:-300}" python3 -m epmoe.bench experts --dtypes bf16,fp8 \
            --local-experts $((256 / NGPU)) --decode-ranks "$NGPU" \
            --out "$OUT/experts_ep$NGPU.json" >"$OUT/ep_experts.log" 2>&1
        ;;
    info)
        python3 -m epmoe.info >"$OUT/info.log" 2>&1 && python3 -m epmoe.info --json >"$OUT/info.json"
        ;;
    decode_ht)
        timeout "${DECODE_HT_LIMIT_S:-200}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench layer \
            --parts layer --tokens 128 --max-num-tokens 128 --experts triton \
            --backends symm_ll symm_ht --iters 10 --out "$OUT/layer_decode_ht.json" >"$OUT/decode_ht.log" 2>&1
        ;;
    rows)
        timeout "${ROWS_COMM_LIMIT_S:-150}" python3 launch/run.py --nproc "$NGPU" -m epmoe.bench comm \
            --tokens 1 128 512 --backends symm_ll:expert_batched symm_ll:expert_batched:copy \
            --iters 20 --warmup 5 --out "$OUT/comm_rows.json" >"$OUT/rows.log" 2>&1
        failed=$?
        for rows in in_place copy; do
            for wd in bf16 fp8; do
                extra=(); [ "$wd" = fp8 ] && extra=(--weight-dtype float8_e4m3fn)
                EPMOE_SYMM_LL_ROWS=$rows timeout "${ROWS_LAYER_LIMIT_S:-100}" python3 launch/run.py \
                    --nproc "$NGPU" -m epmoe.bench layer --parts layer --tokens 128 \
                    --max-num-tokens 128 --experts triton --backends symm_ll "${extra[@]}" \
                    --iters 10 --out "$OUT/layer_${rows}_$wd.json" >>"$OUT/rows.log" 2>&1 || failed=1
            done
        done
        [ "$failed" -eq 0 ]
        ;;
    timeline)
        failed=0
        for variant in ${TIMELINE_VARIANTS:-default}; do
            settings=(); [ "$variant" != default ] && IFS=, read -ra settings <<<"$variant"
            echo "### $variant" >>"$OUT/timeline.log"
            env "${settings[@]}" timeout "${TIMELINE_LIMIT_S:-90}" python3 launch/run.py \
                --nproc "$NGPU" -m epmoe.bench timeline --tokens 128 \
                --out "$OUT/timeline_${variant//[=,]/_}.json" >>"$OUT/timeline.log" 2>&1 || failed=1
        done
        [ "$failed" -eq 0 ]
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
