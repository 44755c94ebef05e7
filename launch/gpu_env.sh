# Sourced by the GPU scripts (from the repository root): import path, unbuffered output,
# NVLink multicast off (it can take a shared host's GPUs out of service), Triton tilings
# from the shipped tables or heuristics (no autotune pauses mid-run), $OUT, $NGPU.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_TRITON_AUTOTUNE="${EPMOE_TRITON_AUTOTUNE:-0}"
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
