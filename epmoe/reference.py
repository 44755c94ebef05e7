"""Ground truth for every MoE test: a loop over experts in plain torch.

Shape legend: T tokens · H hidden size · I expert intermediate size · E experts · K top-k.

``moe`` computes ``out[t] = Σ_k w[t, k] · expert_{ids[t, k]}(x[t])`` expert by expert,
accumulating in ``compute_dtype`` (float64 by default), so that it is obviously right and
far more precise than any kernel it checks. It is meant for small and medium shapes in
tests, not for speed. Every backend × placement × experts combination is compared to it
with ``assert_close`` and the per-dtype ``TOLERANCES``.

Weights: ``w13 [E, 2I, H]`` (gate rows ``[:I]``, then up rows ``[I:]``) and ``w2 [E, H, I]``;
activation ``silu`` is ``silu(gate) * up``, ``gelu`` is ``gelu(gate) * up`` with the exact
(erf) gelu. FP8 weights (``float8_e4m3fn``) come with float32 scales per 128×128 block
(DeepSeek-V3's format) or one per expert, and are dequantized before use.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

__all__ = [
    "ACTIVATIONS",
    "TOLERANCES",
    "moe",
    "expert_mlp",
    "quantize_block",
    "dequantize_block",
    "quantize_groups",
    "relative_error",
    "assert_close",
]

ACTIVATIONS = ("silu", "gelu")
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest float8_e4m3fn value
FP8_EPS = 1e-10  # smallest amax a scale is computed from (all-zero blocks and groups)

# Relative tolerance (‖out − ref‖ / ‖ref‖) of an implementation computing in each dtype,
# against this module's float64 oracle. Read-only.
TOLERANCES: types.MappingProxyType[torch.dtype, float] = types.MappingProxyType(
    {
        torch.float64: 1e-10,
        torch.float32: 1e-5,
        torch.float16: 5e-3,
        torch.bfloat16: 2e-2,
        torch.float8_e4m3fn: 6e-2,
    }
)


def expert_mlp(
    x: torch.Tensor, w13_e: torch.Tensor, w2_e: torch.Tensor, activation: str = "silu"
) -> torch.Tensor:
    """One gated expert MLP: ``(act(x @ gate.T) * (x @ up.T)) @ w2_e.T``.

    Args:
        x: ``[N, H]``.
        w13_e: ``[2I, H]``, gate rows ``[:I]`` then up rows ``[I:]``.
        w2_e: ``[H, I]``.
        activation: ``"silu"`` or ``"gelu"`` (exact, erf form).

    Returns:
        ``[N, H]``. Computes in the inputs' dtype (all three must match; nothing is cast),
        so callers choose the precision.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check_tensors(x=x, w13_e=w13_e, w2_e=w2_e)
    if x.dim() != 2 or w13_e.dim() != 2 or w2_e.dim() != 2:
        raise ValueError(
            "expert_mlp takes x [N, H], w13_e [2I, H], w2_e [H, I]; got shapes "
            f"{tuple(x.shape)}, {tuple(w13_e.shape)}, {tuple(w2_e.shape)}"
        )
    H = x.shape[1]
    two_I = w13_e.shape[0]
    if two_I % 2 != 0 or w13_e.shape[1] != H or tuple(w2_e.shape) != (H, two_I // 2):
        raise ValueError(
            f"expert_mlp shapes do not fit: x {tuple(x.shape)}, w13_e {tuple(w13_e.shape)} "
            f"(expected [2I, {H}] with even 2I), w2_e {tuple(w2_e.shape)} (expected "
            f"[{H}, {two_I // 2}])"
        )
    if not (x.dtype == w13_e.dtype == w2_e.dtype):
        raise TypeError(
            f"expert_mlp needs one dtype for x, w13_e, w2_e; got {x.dtype}, {w13_e.dtype}, "
            f"{w2_e.dtype} (cast them to the compute dtype first)"
        )
    I = two_I // 2
    gate_up = x @ w13_e.t()
    gate, up = gate_up[:, :I], gate_up[:, I:]
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="none")
    return (act * up) @ w2_e.t()


def _check_tensors(**tensors: object) -> None:
    """A ``TypeError`` naming the first argument that is not a ``torch.Tensor``."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _quant_dtype(x: torch.Tensor) -> torch.dtype:
    """Compute in float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _block_size(block: object) -> int:
    """``block`` as a positive int (a float or a bool is refused, never truncated)."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int (e.g. 128), got {block!r}")
    return block


def quantize_block(
    w: torch.Tensor, block: int = FP8_BLOCK, per_matrix: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [E, N, M]`` to ``float8_e4m3fn`` in DeepSeek-V3's weight format.

    Scales are ``max(amax, 1e-10) / 448`` (float32) per ``block × block`` tile, shape
    ``[E, ceil(N/block), ceil(M/block)]`` (the last tiles may be partial), or one per matrix
    (``[E]``) with ``per_matrix``; values are ``w / scale`` cast to FP8. Computes in float32
    (float64 for float64 input). ``dequantize_block`` inverts it up to the FP8 rounding.
    """
    if w.dim() != 3:
        raise ValueError(f"w must be [E, N, M], got shape {tuple(w.shape)}")
    block = _block_size(block)
    x = w.to(_quant_dtype(w))
    if per_matrix:
        s = x.abs().amax(dim=(1, 2)).clamp(min=FP8_EPS) / FP8_MAX
        return (x / s[:, None, None]).to(torch.float8_e4m3fn), s.float()
    E, N, M = w.shape
    nb, mb = math.ceil(N / block), math.ceil(M / block)
    tiles = F.pad(x, (0, mb * block - M, 0, nb * block - N)).view(E, nb, block, mb, block)
    s = tiles.abs().amax(dim=(2, 4)).clamp(min=FP8_EPS) / FP8_MAX
    q = (tiles / s[:, :, None, :, None]).view(E, nb * block, mb * block)[:, :N, :M]
    return q.to(torch.float8_e4m3fn), s.float()


def quantize_groups(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations ``x [..., D]`` to ``float8_e4m3fn`` per token and group of
    ``group`` columns: returns ``(q [..., D], scale [..., ceil(D/group)])`` with float32
    scales ``max(amax, 1e-10) · float32(1/448)`` (the product the Triton kernel computes)
    and ``q = clamp(x · (1 / scale), ±448)`` rounded to nearest even: one correctly rounded
    reciprocal per group, then a product per value (what the kernels compute: a correctly
    rounded division per value costs microseconds on a decode dispatch's path)."""
    D = x.shape[-1]
    G = math.ceil(D / group)
    xp = F.pad(x.float(), (0, G * group - D)).unflatten(-1, (G, group))
    scale = xp.abs().amax(-1).clamp(min=FP8_EPS) * (1.0 / FP8_MAX)
    inv = torch.reciprocal(scale).unsqueeze(-1)
    q = (xp * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :D], scale


def dequantize_block(
    w: torch.Tensor,
    scale: torch.Tensor | float | None,
    block: int = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize ``w [..., N, M]`` (e.g. ``float8_e4m3fn``) to ``dtype``.

    ``scale`` is one of:

    * ``None``: unit scale (a plain cast);
    * block scales ``[..., ceil(N/block), ceil(M/block)]``: element ``(n, m)`` is multiplied
      by ``scale[..., n // block, m // block]`` (the last blocks may be partial);
    * per-matrix scales of shape ``w.shape[:-2]`` (``[E]`` for ``[E, N, M]`` weights), or a
      Python float / 0-d tensor for the whole tensor.

    Returns ``[..., N, M]`` in ``dtype``.
    """
    if w.dim() < 2:
        raise ValueError(f"w must be at least 2-D [..., N, M], got shape {tuple(w.shape)}")
    block = _block_size(block)
    out = w.to(dtype)
    if scale is None:
        return out
    if not isinstance(scale, torch.Tensor):
        return out * float(scale)
    scale = scale.to(device=w.device, dtype=dtype)
    lead, (N, M) = tuple(w.shape[:-2]), tuple(w.shape[-2:])
    nb, mb = math.ceil(N / block), math.ceil(M / block)
    if scale.dim() == 0:
        return out * scale
    if tuple(scale.shape) == lead:
        return out * scale[..., None, None]
    if tuple(scale.shape) == (*lead, nb, mb):
        full = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
        return out * full[..., :N, :M]
    raise ValueError(
        f"scale of shape {tuple(scale.shape)} does not fit weights {tuple(w.shape)}: expected "
        f"block scales {(*lead, nb, mb)} ({block}×{block} blocks) or per-matrix scales {lead}"
    )


def moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    compute_dtype: torch.dtype = torch.float64,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference MoE forward, one expert at a time.

    Args:
        hidden_states: ``[T, H]`` floating; ``T`` may be 0.
        w13: ``[E, 2I, H]`` gate rows then up rows; floating or ``float8_e4m3fn``.
        w2: ``[E, H, I]``; floating or ``float8_e4m3fn``.
        topk_weights: ``[T, K]`` floating router weights.
        topk_ids: ``[T, K]`` int32/int64 expert ids in ``[0, E)``; ``-1`` means no expert
            (the entry is skipped, e.g. experts held by another rank).
        activation: ``"silu"`` or ``"gelu"`` (exact erf form), applied to the gate.
        apply_router_weight_on_input: if True, ``out[t] = Σ_k expert_k(w[t, k] · x[t])``
            (the weight scales the input, as Llama-4 does); else
            ``out[t] = Σ_k w[t, k] · expert_k(x[t])``.
        compute_dtype: precision of every product and of the accumulation.
        w13_scale: dequantization scales of ``w13`` (see ``dequantize_block``): block
            ``[E, ceil(2I/128), ceil(H/128)]`` or per-expert ``[E]``; ``None`` means unit
            scale.
        w2_scale: those of ``w2``: block ``[E, ceil(H/128), ceil(I/128)]`` or ``[E]``.

    Returns:
        ``[T, H]`` in ``hidden_states.dtype`` on its device (rows without any expert are 0).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise TypeError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")
    _check_tensors(
        hidden_states=hidden_states,
        w13=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
    )
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if not (scale is None or isinstance(scale, (torch.Tensor, float, int))) or isinstance(
            scale, bool
        ):
            raise TypeError(
                f"{name} must be a tensor of scales, a float or None, got {type(scale).__name__}"
            )
    if hidden_states.dim() != 2 or not hidden_states.is_floating_point():
        raise ValueError(
            f"hidden_states must be a floating [T, H] tensor, got {hidden_states.dtype} "
            f"{tuple(hidden_states.shape)}"
        )
    T, H = hidden_states.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    for name, w in (("w13", w13), ("w2", w2)):
        if not w.is_floating_point():  # float8_e4m3fn counts as floating
            raise TypeError(
                f"{name} must be floating point (or float8_e4m3fn with scales), got {w.dtype}; "
                "integer, bool or complex weights are not expert weights"
            )
    E, two_I, H13 = w13.shape
    if two_I % 2 != 0:
        raise ValueError(f"w13 must be [E, 2I, H] with an even 2I, got {tuple(w13.shape)}")
    I = two_I // 2
    if H13 != H or tuple(w2.shape) != (E, H, I):
        raise ValueError(
            f"weights do not fit hidden_states [T={T}, H={H}]: w13 {tuple(w13.shape)} must be "
            f"[E, 2I, {H}] and w2 {tuple(w2.shape)} must be [E={E}, {H}, I={I}]"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be [T={T}, K], got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
            "must have the same [T, K] shape"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_ids.numel() > 0:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < -1 or hi >= E:
            raise ValueError(
                f"topk_ids hold values in [{lo}, {hi}]; expected -1 (skip) or ids in [0, {E})"
            )

    device = hidden_states.device
    w13_c = dequantize_block(w13, w13_scale, FP8_BLOCK, compute_dtype).to(device)
    w2_c = dequantize_block(w2, w2_scale, FP8_BLOCK, compute_dtype).to(device)
    x_TH = hidden_states.to(compute_dtype)
    ids_TK = topk_ids.to(device=device, dtype=torch.int64)
    w_TK = topk_weights.to(device=device, dtype=compute_dtype)

    out_TH = torch.zeros(T, H, dtype=compute_dtype, device=device)
    for e in range(E):
        tok, k = torch.nonzero(ids_TK == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w_N1 = w_TK[tok, k].unsqueeze(1)
        x_NH = x_TH[tok]
        if apply_router_weight_on_input:
            y_NH = expert_mlp(x_NH * w_N1, w13_c[e], w2_c[e], activation)
        else:
            y_NH = expert_mlp(x_NH, w13_c[e], w2_c[e], activation) * w_N1
        out_TH.index_add_(0, tok, y_NH)
    return out_TH.to(hidden_states.dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖₂ / ‖ref‖₂`` over all elements, computed in float64.

    0.0 when both are empty (or both all-zero); ``inf`` when either holds a NaN or an
    infinity, or when ``ref`` is all-zero and ``out`` is not. Shapes must match.
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(
            f"relative_error needs equal shapes, got out {tuple(out.shape)} and ref "
            f"{tuple(ref.shape)}"
        )
    if ref.numel() == 0:
        return 0.0
    o = out.detach().to(device=ref.device, dtype=torch.float64)
    r = ref.detach().to(torch.float64)
    if not (bool(torch.isfinite(o).all()) and bool(torch.isfinite(r).all())):
        return math.inf
    diff = float(torch.linalg.vector_norm(o - r))
    norm = float(torch.linalg.vector_norm(r))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


# assert_close's check of each row on its own: a row's error within ROW_FACTOR * rtol of
# the larger of its norm and the rows' RMS norm
ROW_FACTOR = 8


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    rtol: float | None = None,
    name: str = "",
    row_rtol: float | None = None,
) -> None:
    """Raise AssertionError if ``relative_error(out, ref) > rtol``, or if any row (leading
    index) is wrong on its own: over many rows one wrong row hides in the whole (a wrong
    row among R moves the error by about ``1/√R``). Always: each row's error against its
    norm or the rows' RMS norm, whichever is larger, within ``ROW_FACTOR * rtol`` (a
    zeroed or missing row fails; a near-zero row's relative noise does not). With
    ``row_rtol`` instead: each row's error against its own norm within ``row_rtol``.

    ``rtol`` defaults to ``TOLERANCES[out.dtype]``. The message gives the measured error,
    the tolerance, both shapes and dtypes, and the worst row with its error and
    reference norm, so a failure says where to look.
    """
    label = f"{name}: " if name else ""
    if rtol is None:
        if out.dtype not in TOLERANCES:
            raise ValueError(f"no default tolerance for {out.dtype}; pass rtol explicitly")
        rtol = TOLERANCES[out.dtype]
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(
            f"{label}shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}"
        )
    err = relative_error(out, ref)
    if err <= rtol and out.numel() == 0:
        return
    o = out.detach().to(device=ref.device, dtype=torch.float64)
    r = ref.detach().to(torch.float64)
    if o.dim() == 0:
        o, r = o.reshape(1), r.reshape(1)
    o_rows, r_rows = o.reshape(o.shape[0], -1), r.reshape(r.shape[0], -1)
    row_err = torch.linalg.vector_norm(o_rows - r_rows, dim=1)
    row_err = torch.nan_to_num(row_err, nan=math.inf)
    row_norm = torch.linalg.vector_norm(r_rows, dim=1)
    if err <= rtol and row_rtol is None and o_rows.shape[0] > 1:  # each row, against a floor
        floor = float(row_norm.square().mean().sqrt())
        scale = torch.clamp(row_norm, min=floor)
        rel = torch.where(scale > 0, row_err / scale, torch.where(row_err > 0, math.inf, 0))
        if float(rel.max()) > ROW_FACTOR * rtol:
            worst = int(torch.argmax(rel))
            raise AssertionError(
                f"{label}row {worst} is off on its own: error {float(row_err[worst]):.3e} "
                f"against max(its norm {float(row_norm[worst]):.3e}, the rows' RMS "
                f"{floor:.3e}) = {float(rel[worst]):.3e} > {ROW_FACTOR} * rtol (the whole: "
                f"{err:.3e}); out {tuple(out.shape)} {out.dtype}, ref {tuple(ref.shape)} "
                f"{ref.dtype}"
            )
    if err <= rtol and row_rtol is None:
        return
    if err <= rtol:  # (row_rtol given): each row against its own norm
        rel = torch.where(row_norm > 0, row_err / row_norm, torch.where(row_err > 0, math.inf, 0))
        if float(rel.max()) <= row_rtol:
            return
        worst = int(torch.argmax(rel))
        raise AssertionError(
            f"{label}row {worst}'s relative error {float(rel[worst]):.3e} > row_rtol "
            f"{row_rtol:.1e} (the whole: {err:.3e}); out {tuple(out.shape)} {out.dtype}, ref "
            f"{tuple(ref.shape)} {ref.dtype}"
        )
    worst = int(torch.argmax(row_err))
    raise AssertionError(
        f"{label}relative error {err:.3e} > rtol {rtol:.1e}; out {tuple(out.shape)} "
        f"{out.dtype}, ref {tuple(ref.shape)} {ref.dtype}; worst row {worst}: "
        f"‖Δ‖ = {float(row_err[worst]):.3e}, ‖ref‖ = {float(row_norm[worst]):.3e}"
    )
