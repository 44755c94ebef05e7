"""Triton kernels of the expert MLPs and their host wrappers.

``align`` groups the (row, k) pairs of the Standard layout by local expert (padded to the
GEMM row block, no host sync); ``grouped_gemm`` holds GEMM 1 (gate and up in one program,
``act(gate)·up`` fused, FP8 re-quantization of its output fused) and GEMM 2 (router weight
applied for the Standard layout), each for the Standard and the ExpertBatched layout;
``reduce`` sums each row's pairs; ``quant`` is the per-token-group FP8 quantization;
``wgmma`` holds the Standard layout's two GEMMs for Hopper (sm_90) in Gluon, imported only
when a ``kernel="wgmma"`` / ``"wgmma_ws"`` config runs.
``ops`` checks, allocates and launches (``fused_moe_standard``, ``fused_moe_batched``);
``configs`` picks block sizes (tuned tables in ``configs/<device>.json``, autotuning,
heuristics). Importing this package compiles nothing and touches no device.
"""
