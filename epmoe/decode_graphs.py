"""CUDA-graph decode buckets: one captured forward per batch size, replayed in decode steps.

A decode step moves a few tokens per rank through every MoE layer; launched from Python,
the layer's kernels cost more host time than GPU time. Serving engines capture the decode
forward once per batch-size bucket and replay the smallest bucket that holds the step's
largest token count, padding the batch. :class:`DecodeGraphs` does that for one MoE
forward (an ``EPMoE`` with its router, e.g. an ``EPMoEBlock``)::

    graphs = epmoe.DecodeGraphs(block, sizes=(1, 2, 4, 8, 16), layers=[block.moe])  # collective
    with epmoe.step(group, num_tokens=T, decode=True, graph_max_tokens=graphs.max_tokens):
        out = graphs(x_TH)             # a replay, or None: run the eager forward

Each bucket ``b`` is captured inside its own ``epmoe.step(num_tokens=b, decode=True)`` (so
every layer is captured for ``b`` tokens on every rank, with no collective of its own);
a replay copies this rank's ``T ≤ b`` rows into the static input and passes ``T`` as the
forward's ``num_valid_tokens`` (a device tensor), so the padding rows go to no expert.
The bucket is the step's (agreed on every rank), so every rank replays the same graph.

A captured graph holds the addresses of the layers' weights, placement maps and comm
buffers: after a re-plan (``EPMoE.rebalance``) the graphs are stale. ``__call__`` refuses
stale graphs (it compares what the layers hold now with what they held at capture);
:meth:`recapture` captures them again (collective, on every rank, after the re-plan).

Shape legend: T tokens on this rank · b bucket size (T ≤ b) · H hidden.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from epmoe.comm.base import ranks_phrase
from epmoe.comm.collectives import world_of
from epmoe.step_context import StepContext, current_step, group_ranks, step

__all__ = ["DecodeGraphs", "graph_state", "load_recording_paused"]


def graph_state(layers: Sequence) -> list:
    """What a CUDA graph that runs ``layers`` (``EPMoE``) depends on: each layer's
    placement generation and the addresses of its slot tensors (weights, maps). Compare it
    with its value at capture to know whether a re-plan made the graph stale (a graph of a
    whole model's decode step, for example; :class:`DecodeGraphs` does this itself)."""
    return [
        (layer.generation, tuple(t.data_ptr() for t in layer.slot_tensors().values()))
        for layer in layers
    ]


@contextlib.contextmanager
def load_recording_paused(layers: Sequence) -> Iterator[None]:
    """Inside, the load recorders of ``layers`` (``EPMoE``) record nothing: for the warm-up
    forwards before a CUDA-graph capture, which are not expert load. Each recorder's own
    setting is restored after, also on an error."""
    recorders = [r for r in (layer.load_recorder for layer in layers) if r is not None]
    enabled = [r.enabled for r in recorders]
    for r in recorders:
        r.enabled = False
    try:
        yield
    finally:
        for r, on in zip(recorders, enabled):
            r.enabled = on


def _agree(group: dist.ProcessGroup | None, error: Exception | None, config: str) -> None:
    """Before the captures (collective): every rank learns whether one refused its
    arguments (it raises its own error, the others a ``RuntimeError`` naming it) and
    whether the ranks' buckets, hidden size and dtype differ (each would replay another
    graph: every rank raises naming them). One object all-gather; nothing on one rank."""
    _, world = world_of(group)
    if world == 1:
        if error is not None:
            raise error
        return
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (error is not None, config), group=group)
    if error is not None:
        raise error
    refused = [r for r, (bad, _) in enumerate(gathered) if bad]
    if refused:
        raise RuntimeError(
            f"DecodeGraphs: {ranks_phrase(refused, 'refused')} "
            f"{'its' if len(refused) == 1 else 'their'} arguments (each one's own error "
            "says why); this rank stopped too, before the captures"
        )
    configs = [c for _, c in gathered]
    if len(set(configs)) > 1:
        listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(configs))
        raise ValueError(
            f"DecodeGraphs: the ranks asked for different graphs ({listing}); build them with "
            "the same sizes, hidden_size and dtype on every rank"
        )


class DecodeGraphs:
    """Captured decode forwards of ``forward`` for each bucket size in ``sizes``.

    Args:
        forward: ``forward(x [b, H], num_valid_tokens=n) -> [b, H]`` (or a tuple of tensors
            whose first dimension is ``b``): the MoE forward to capture, with its router
            (an ``EPMoEBlock``, or a function calling ``EPMoE`` layers). Its layers must use
            a graph-safe backend and graph-safe experts for decode-sized steps.
        sizes: the bucket sizes (tokens per rank), e.g. ``(1, 2, 4, 8, 16, 32)``.
        hidden_size: the input rows' H.
        dtype: the input rows' dtype.
        device: the input rows' device (a CUDA device).
        layers: the ``EPMoE`` layers ``forward`` runs: checked to be graph safe at every
            bucket, and watched for re-plans (stale graphs are refused).
        group: the EP group of the steps (``None``: WORLD, or one process).
        warmup: eager forwards per bucket before its capture (compiles Triton kernels and
            picks their tilings outside the capture; not recorded as expert load).
        pool: the CUDA-graph memory pool (``torch.cuda.graph_pool_handle()``) to capture
            into; default: one of its own, shared by its buckets. Pass one pool to the
            ``DecodeGraphs`` of every layer of a model: their replays run one after another
            and outputs are copied out, so they can share the intermediates' memory (the
            expert kernels' scratch is sized by the layer's ``max_num_tokens``, not the
            bucket, so separate pools grow with layers × buckets).

    Collective: every rank of ``group`` builds it (and :meth:`recapture` s it) with the same
    sizes, in the same order relative to its other collectives. Construction agrees first
    (one object all-gather): a rank's bad argument, or sizes, hidden size or dtype that
    differ between ranks, raise on every rank before any capture.
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
        sizes: Sequence[int],
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layers: Sequence = (),
        group: dist.ProcessGroup | None = None,
        warmup: int = 2,
        pool: tuple | None = None,
    ) -> None:
        device = torch.device(device)
        error: Exception | None = None
        if device.type != "cuda":
            error = ValueError(
                f"DecodeGraphs captures CUDA graphs: device must be cuda, got {device}"
            )
        try:
            clean = sorted({int(s) for s in sizes}) if sizes else []
        except (TypeError, ValueError):
            clean = []
        if not clean or clean[0] <= 0 or any(isinstance(s, bool) for s in sizes):
            error = error or ValueError(
                f"sizes must be positive token counts, e.g. (1, 2, 4, 8), got {sizes!r}"
            )
        _agree(group, error, f"sizes={clean}, hidden_size={hidden_size}, dtype={dtype}")
        self.forward, self.sizes, self.layers = forward, tuple(clean), list(layers)
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.group, self.warmup = group, warmup
        self.replays = 0  # decode calls served by a graph
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self._ranks = group_ranks(group)  # what a step on the same group holds
        self._graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, object]
        ] = {}
        self._state: list | None = None
        self._layer_dtypes: list | None = None  # the layers' dtypes at the first capture
        self.recapture()

    def _rows_error(self, x_TH, b: int) -> Exception | None:
        """What is wrong with this rank's rows for bucket ``b``, or ``None``."""
        if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2:
            got = tuple(x_TH.shape) if isinstance(x_TH, torch.Tensor) else type(x_TH).__name__
            return ValueError(f"the decode graphs take rows [T, H={self.hidden_size}], got {got}")
        T = x_TH.shape[0]
        if x_TH.shape[1] != self.hidden_size:
            return ValueError(
                f"the decode graphs take rows of H={self.hidden_size}, got {list(x_TH.shape)}"
            )
        if x_TH.dtype != self.dtype:
            return TypeError(f"the decode graphs take {self.dtype} rows, got {x_TH.dtype}")
        if b < T:
            return ValueError(
                f"this rank has T={T} rows, above the step's bucket {b}: open the step with "
                "this rank's token count (epmoe.step(..., num_tokens=T))"
            )
        return None

    @property
    def max_tokens(self) -> int:
        """The largest bucket: ``epmoe.step(..., graph_max_tokens=graphs.max_tokens)``."""
        return self.sizes[-1]

    @property
    def stale(self) -> bool:
        """Whether a layer was re-planned since the capture (then :meth:`recapture`, on
        every rank: a re-plan happens on every rank, so they agree)."""
        return graph_state(self.layers) != self._state

    def recapture(self) -> None:
        """(Re)capture every bucket (collective). Call on every rank after a re-plan."""
        dtypes = [layer.params_dtype for layer in self.layers]
        if self._layer_dtypes is not None and dtypes != self._layer_dtypes:
            raise RuntimeError(
                f"the layers compute in {sorted(set(map(str, dtypes)))} since .to(dtype), "
                f"these graphs in {sorted(set(map(str, self._layer_dtypes)))} with "
                f"{self.dtype} rows: build new DecodeGraphs (dtype=...) instead of recapture()"
            )
        self._layer_dtypes = dtypes
        for b in self.sizes:
            for layer in self.layers:
                comm, _ = layer._comm_for(b)
                if not comm.capabilities.graph_safe:
                    raise ValueError(
                        f"a decode step of {b} tokens runs backend {comm.name!r}, which is not "
                        "graph safe; build the layers with a graph-safe decode backend "
                        "(symm_ll, or backend='auto' on one NVLink node) or smaller sizes"
                    )
        self._graphs.clear()
        torch.cuda.synchronize(self.device)
        for b in reversed(self.sizes):  # the largest first: later ones reuse its pool memory
            x_bH = torch.zeros(b, self.hidden_size, dtype=self.dtype, device=self.device)
            n = torch.full((1,), b, dtype=torch.int32, device=self.device)
            with step(self.group, num_tokens=b, decode=True), torch.no_grad():
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side), load_recording_paused(self.layers):
                    for _ in range(self.warmup):
                        self.forward(x_bH, num_valid_tokens=n)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=self.pool):
                        out = self.forward(x_bH, num_valid_tokens=n)
                except RuntimeError as exc:
                    raise RuntimeError(
                        f"capturing the decode forward for {b} tokens failed ({exc}); its "
                        "layers need a graph-safe backend and experts (experts='triton')"
                    ) from exc
            self._graphs[b] = (graph, x_bH, n, out)
        torch.cuda.synchronize(self.device)
        self._state = graph_state(self.layers)

    def __call__(self, x_TH: torch.Tensor, step_ctx: StepContext | None = None):
        """This rank's rows through the graph of the step's bucket, or ``None`` when the
        step is not a graph step (no active step, not an agreed decode step, or larger than
        every bucket): then run the eager forward. Outputs are copies of the first ``T``
        rows (the graph's own buffers are overwritten by its next replay). Rows this
        step cannot take (not ``[T, H]`` of the graphs' dtype, or ``T`` above the bucket)
        raise here, after a replay of the bucket with no rows: the other ranks, which
        replay it too, finish this graph instead of waiting for this rank's dispatch. (Where
        a step replays several graphs, one per layer, the others then wait in the next
        one's dispatch until its backend's bounded wait gives up: give a step's graphs the
        same rows, or capture the step's layers in one graph.)"""
        s = step_ctx if step_ctx is not None else current_step()
        if s is None or not s.decode:
            return None
        if s.ranks != self._ranks:
            raise ValueError(
                f"the step is on ranks {list(s.ranks)}, the decode graphs on "
                f"{list(self._ranks)}; open the step on the layers' EP group"
            )
        b = s.bucket(self.sizes)
        if b is None:
            return None
        if self.stale:
            raise RuntimeError(
                "the layers' placement, weights or dtype changed since the decode graphs "
                "were captured: call recapture() on every rank after a rebalance; after "
                ".to(dtype), build new DecodeGraphs for rows of the new dtype"
            )
        graph, x_bH, n, out = self._graphs[b]
        error = self._rows_error(x_TH, b)
        if error is not None:
            # every rank replays this bucket in this step: replay it without rows here, so
            # that the others' dispatches meet this rank's and they finish the step
            x_bH.zero_()
            n.fill_(0)
            graph.replay()
            raise error
        T = x_TH.shape[0]
        x_bH[:T].copy_(x_TH)
        x_bH[T:].zero_()
        n.fill_(T)
        graph.replay()
        self.replays += 1
        if isinstance(out, torch.Tensor):
            return out[:T].clone()
        return tuple(o[:T].clone() for o in out)
