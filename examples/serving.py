"""DP/EP serving of a Hugging Face MoE model with epmoe: attention data-parallel (each rank
serves its own request queue), MoE layers expert-parallel.

    python launch/run.py examples/serving.py                    # 2 gloo ranks on CPU
    python launch/run.py --nproc 2 examples/serving.py --requests 64 --max-batch 16

Each rank takes batches of up to ``--max-batch`` requests from its queue, prefills their
prompts in chunks of ``--prefill-chunk`` positions, then decodes them greedily, one token
per request and step, until each has its ``max_new_tokens`` (a finished request leaves
the batch, or with a static cache stays as a row that the MoE blocks skip); then the next
batch. Every
model forward is one DP step (``epmoe.step``): the ranks agree once on the step's largest
token count and every MoE layer uses it, with no collective of its own; a rank with nothing
to do runs the MoE layers with zero tokens (the others need it in their collectives), and
the loop ends at the first step in which no rank has tokens. The layers record their
expert load, and ``epmoe.EPLBManager`` re-plans the placement every ``--rebalance-every``
steps while serving, moving only the experts whose slots change.

Rank 0 prints a line every ``--log-every`` steps (tokens/s of the group, steps, the
balancedness of the experts' load over the ranks) and, at the end, throughput and
time-to-first-token / inter-token-latency percentiles of every request of every rank.
On GPUs the same loop runs with ``--device cuda`` (NCCL). ``--cuda-graphs`` (CUDA, a
graph-safe decode backend such as ``symm_ll``) replays decode steps, agreed as such on every
rank, from CUDA graphs:

* ``--cuda-graphs`` / ``--cuda-graphs step``: the whole decode step (embedding, attention,
  MoE blocks, logits, greedy tokens) in one graph per batch size (``--graph-sizes``,
  default 1, 2, 4, ... up to ``--max-batch``); a step replays the smallest that holds every
  rank's batch, padding rows routed to no expert. The KV cache is transformers'
  ``StaticCache`` (a bucket's forward uses its first rows) and the example builds the
  attention mask itself, so that a step's inputs live in fixed tensors (``StaticEngine``,
  which ``--static-cache`` runs eagerly, also on CPU). Every rank's decode step is then
  the same kernels, with no Python between them, so ranks reach each MoE block's dispatch
  together. On CPU nothing is captured: the step runs eagerly through the same path
  (buckets, idle ranks' replays, re-captures).
* ``--cuda-graphs blocks``: only the MoE blocks, for the same batch sizes
  (``EPMoEBlock.capture_decode_graphs``; the smallest that holds the step's largest
  batch, padding rows routed to no expert); attention stays eager.

Prefill steps and larger batches run eagerly, and a re-plan is followed by a re-capture.
Needs ``pip install "epmoe[hf]"``.

Shape legend: B requests in a batch · S positions in a forward · H hidden · E experts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import epmoe
from epmoe.decode_graphs import graph_state, load_recording_paused
from epmoe.distributed import default_device, normalize_device
from epmoe.eplb.manager import measured_balancedness, measured_rank_load
from epmoe.integrations.huggingface import EPMoEBlock, padded_batch, replace_moe_blocks


@dataclass
class Request:
    """One request: its prompt, how many tokens to generate, and when each one came."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


def build_model(args: argparse.Namespace, device: torch.device):
    """A small Mixtral with random weights, the same on every rank (a shared seed)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=1024,
        initializer_range=0.1,  # larger than a trained model's: decisive routing
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device, torch.float32).eval()


def load_checkpoint(args: argparse.Namespace, group, rank: int, device: torch.device):
    """The model of ``--checkpoint`` loaded by shard (each rank reads its own experts;
    ``--fp8-experts`` keeps them in FP8, else they are dequantised), and with ``--check``
    the same checkpoint loaded whole on this rank alone (a one-rank group) as the
    reference."""
    from epmoe.integrations.huggingface import from_pretrained_sharded

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    fp8 = dict(weight_dtype=torch.float8_e4m3fn) if args.fp8_experts else {}
    model = from_pretrained_sharded(
        args.checkpoint, group=group, backend=args.backend, dtype=dtype, device=device,
        load_window=args.rebalance_every, dispatch_dtype=_dispatch_dtype(args), **fp8,
    )  # fmt: skip
    reference = None
    if args.check:
        alone = dist.new_group([rank], use_local_synchronization=True) if group else None
        reference = from_pretrained_sharded(
            args.checkpoint, group=alone, dtype=dtype, device=device, **fp8
        )
    return model, reference


def make_requests(rank: int, args: argparse.Namespace) -> list[Request]:
    """This rank's queue: random prompt lengths and output lengths (a per-rank seed, so
    ranks are unevenly loaded and finish at different steps)."""
    rng = random.Random(1000 + rank)
    n = args.requests + rng.randint(-args.requests // 4, args.requests // 4)
    return [
        Request(
            rid=f"r{rank}-{i}",
            prompt=[rng.randint(3, args.vocab - 1) for _ in range(rng.randint(4, args.max_prompt))],
            max_new_tokens=rng.randint(2, args.max_new_tokens),
        )
        for i in range(max(n, 1))
    ]


def greedy_tokens(model, inputs: dict, cache) -> torch.Tensor:
    """``model`` on ``inputs`` with KV ``cache``: every row's greedy next token ``[B]``. Only
    the last position's logits are computed (a prefill chunk's others are never read)."""
    out = model(**inputs, **{_CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1)


class Engine:
    """One rank's scheduler: static batches of requests, chunked prefill, batched decode.
    ``next_forward()`` gives the next model call of this rank (or ``None`` when idle)."""

    def __init__(self, model, queue: list[Request], args: argparse.Namespace, device):
        self.model, self.queue, self.args, self.device = model, list(queue), args, device
        self.batch: list[Request] = []
        self.plan: list[tuple[int, int]] = []  # prefill chunks (start, end) still to run
        self.cache = None
        self.graphs: StepGraphs | None = None  # the whole decode step's (StaticEngine)

    def _take_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next requests, their prompts left-padded (every prompt ends at column L):
        ``ids [B, L]`` and ``seen [B, L]`` (1 where a prompt token is), on the host."""
        self.batch, self.queue = (
            self.queue[: self.args.max_batch],
            self.queue[self.args.max_batch :],
        )
        B, L = len(self.batch), max(len(r.prompt) for r in self.batch)
        ids = torch.zeros(B, L, dtype=torch.long)
        seen = torch.zeros(B, L, dtype=torch.long)
        for b, r in enumerate(self.batch):
            ids[b, L - len(r.prompt) :] = torch.tensor(r.prompt)
            seen[b, L - len(r.prompt) :] = 1
        c = self.args.prefill_chunk
        self.plan = [(s, min(s + c, L)) for s in range(0, L, c)]
        return ids, seen

    def _start_batch(self) -> None:
        from transformers import DynamicCache

        ids, mask = self._take_batch()
        self.ids, self.mask = ids.to(self.device), mask.to(self.device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = DynamicCache()

    def _batch_done(self) -> bool:
        return not self.batch or all(r.done for r in self.batch)

    def next_forward(self) -> dict | None:
        """The inputs of this rank's next forward, or ``None`` when it has nothing to do."""
        if self._batch_done():
            if not self.queue:
                return None
            self._start_batch()
        if self.plan:  # prefill: the next chunk of every prompt
            s, e = self.plan.pop(0)
            return dict(
                input_ids=self.ids[:, s:e],
                attention_mask=self.mask[:, :e],
                position_ids=self.positions[:, s:e],
                kind="prefill",
            )
        last = torch.tensor([[r.output[-1]] for r in self.batch], device=self.device)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        self.positions = torch.cat([self.positions, self.positions[:, -1:] + 1], 1)
        return dict(
            input_ids=last,
            attention_mask=self.mask,
            position_ids=self.positions[:, -1:],
            kind="decode",
        )

    def forward(self, inputs: dict) -> torch.Tensor:
        """The model on ``inputs``: every row's greedy next token ``[B]`` (on the device)."""
        with torch.no_grad():
            return greedy_tokens(self.model, inputs, self.cache)

    def run(self, inputs: dict) -> int:
        """Run one forward (inside the caller's step); returns the tokens it emitted."""
        kind = inputs.pop("kind")
        next_B = self.forward(inputs) if kind == "prefill" else self.decode(inputs)
        if kind == "prefill" and self.plan:
            return 0  # more prompt to read before the first token
        now = time.perf_counter()
        emitted, finished = 0, []
        for i, (r, token) in enumerate(zip(self.batch, next_B.tolist())):
            if not r.done:  # (a static batch's finished requests ride along)
                r.output.append(token)
                r.token_times.append(now)
                emitted += 1
                if r.done:
                    finished.append(i)
        if finished:
            self._finished(finished)
        return emitted

    def _finished(self, rows: list[int]) -> None:
        """The requests of these rows of the batch have all their tokens: they leave it,
        with their rows of the mask, the positions and the KV cache (transformers'
        ``batch_select_indices``), so that no later step computes them."""
        gone = set(rows)
        keep = [i for i in range(len(self.batch)) if i not in gone]
        self.batch = [self.batch[i] for i in keep]
        if keep:
            index = torch.tensor(keep, device=self.device)
            self.mask, self.positions = self.mask[index], self.positions[index]
            self.cache.batch_select_indices(index)

    def decode(self, inputs: dict) -> torch.Tensor:
        return self.forward(inputs)


class StaticEngine(Engine):
    """The same scheduler on fixed shapes, so that a decode step can be one CUDA graph.

    Every batch is padded to a bucket of rows b (``sizes``: ``--graph-sizes``, by default
    1, 2, 4, ... and ``--max-batch`` R; the padding rows last): its forwards run on the
    smallest bucket that holds it, and a replayed decode step on the step's bucket, which
    holds every rank's. Padding rows, and the rows of requests that have finished while
    their batch decodes, are routed to no expert (``padded_batch`` of ``live``, a device
    mask). The KV cache is transformers' ``StaticCache``
    of R rows and ``--max-prompt + --max-new-tokens`` positions C, reset in place for each
    batch; a forward of b rows reads and writes its first b rows (``cache_for``: views, the
    same write counters), so a batch keeps its cache whichever bucket a step runs. This
    engine builds the attention mask itself (4-D, ``[b, 1, S, C]``, which transformers
    uses as it is) and keeps a decode step's inputs (token, position, mask, live rows) in
    fixed tensors of R rows that it updates in place (a bucket reads their first b rows).
    A decode step's forward writes its greedy tokens into the next step's input, on the
    device. :class:`StepGraphs` captures it, one graph per bucket.
    Shape legend: R rows (the largest bucket) · b a bucket's rows · S positions in a
    forward · C cache positions."""

    def __init__(self, model, queue: list[Request], args: argparse.Namespace, device, dtype):
        from transformers import StaticCache

        super().__init__(model, queue, args, device)
        R, C = args.max_batch, args.max_prompt + args.max_new_tokens
        self.rows, self.length = R, C
        self.sizes = getattr(args, "graph_sizes", None) or bucket_sizes(R)
        if self.sizes != sorted(set(self.sizes)) or self.sizes[0] < 1 or self.sizes[-1] != R:
            raise ValueError(
                f"graph_sizes must be increasing batch sizes >= 1 ending at max_batch ({R}), "
                f"got {self.sizes}"
            )
        self.cache = StaticCache(config=model.config, max_cache_len=C)
        kinds = sorted({type(layer).__name__ for layer in self.cache.layers})
        if kinds != ["StaticLayer"]:  # e.g. sliding windows: their counters live on the host
            raise ValueError(
                f"the static engine runs full-attention caches only; this model's StaticCache "
                f"has {kinds} layers: serve it without --static-cache / --cuda-graphs step"
            )
        if not hasattr(self.cache.layers[0], "cumulative_length"):
            raise ValueError(
                "the static engine needs transformers >= 5 (a StaticCache whose write "
                "position is a device counter); serve without --static-cache / --cuda-graphs "
                "step, or upgrade transformers"
            )
        self.views: dict[int, object] = {R: self.cache}  # bucket → its rows of the cache
        self.bucket = R  # the rows of this rank's forwards in its current batch
        self.low = torch.finfo(dtype).min  # a masked column's score, as transformers does
        self.step_ids = torch.zeros(R, 1, dtype=torch.long, device=device)
        self.step_pos = torch.zeros(R, 1, dtype=torch.long, device=device)
        self.step_mask = torch.full((R, 1, 1, C), self.low, dtype=dtype, device=device)
        # the rows whose requests still decode: the others are padding in the MoE blocks
        self.live = torch.ones(R, dtype=torch.bool, device=device)

    def cache_for(self, b: int):
        """The KV cache of a forward of ``b`` rows: the first ``b`` rows of every layer of
        the R-row cache (``RowsOf``)."""
        if b not in self.views:
            view = copy.copy(self.cache)  # (its other attributes shared)
            view.layers = [rows_of(layer, b, self.rows) for layer in self.cache.layers]
            self.views[b] = view
        return self.views[b]

    def _start_batch(self) -> None:
        ids, seen = self._take_batch()
        B, L = ids.shape
        longest = L + max(r.max_new_tokens for r in self.batch)
        if longest > self.length:
            raise ValueError(
                f"a batch needs {longest} cache positions, the static cache has {self.length} "
                "(--max-prompt + --max-new-tokens)"
            )
        R = self.rows
        self.ids = torch.zeros(R, L, dtype=torch.long, device=self.device)
        self.ids[:B] = ids.to(self.device)
        self.seen = torch.zeros(R, self.length, dtype=torch.bool, device=self.device)
        self.seen[:B, :L] = seen.to(self.device, torch.bool)
        self.positions = (self.seen[:, :L].long().cumsum(-1) - 1).clamp(min=0)
        self.column = L  # the cache position of the next decode step
        self.cache.reset()  # in place: a captured graph keeps its addresses
        self.live.copy_(torch.arange(R) < B)
        self.bucket = min(b for b in self.sizes if b >= B)

    def _prefill_mask(self, s: int, e: int) -> torch.Tensor:
        """``[b, 1, e - s, C]`` (the batch's bucket): each query attends the prompt's tokens
        at or before it, and itself (so that a padding position's row is never fully
        masked)."""
        j = torch.arange(self.length, device=self.device)
        q = torch.arange(s, e, device=self.device)[:, None]
        allowed = (self.seen[: self.bucket, None, :] & (j <= q)) | (j == q)
        mask = torch.zeros(allowed.shape, dtype=self.step_mask.dtype, device=self.device)
        return mask.masked_fill_(~allowed, self.low)[:, None]

    def next_forward(self) -> dict | None:
        if self._batch_done():
            if not self.queue:
                return None
            self._start_batch()
        b = self.bucket
        if self.plan:
            s, e = self.plan.pop(0)
            return dict(
                input_ids=self.ids[:b, s:e],
                attention_mask=self._prefill_mask(s, e),
                position_ids=self.positions[:b, s:e],
                kind="prefill",
            )
        if self.column == self.ids.shape[1]:  # the batch's first decode step
            self.step_pos.copy_(self.positions[:, -1:])
            self.step_mask.fill_(self.low)
            self.step_mask[:, 0, 0].masked_fill_(self.seen, 0.0)
        self.step_pos += 1
        self.step_mask[..., self.column] = 0.0  # every row attends the new position
        self.column += 1
        return dict(self.decode_inputs(b), kind="decode")

    def forward(self, inputs: dict) -> torch.Tensor:
        """The model on ``inputs`` of b rows (a bucket): the greedy tokens ``[b]``, also
        written into the next decode step's input."""
        b, S = inputs["input_ids"].shape
        live = self.live[:b] if S == 1 else self.live[:b].repeat_interleave(S)  # (flattened)
        with torch.no_grad(), padded_batch(live):
            next_b = greedy_tokens(self.model, inputs, self.cache_for(b))
            self.step_ids[:b].copy_(next_b[:, None])
        return next_b

    def _finished(self, rows: list[int]) -> None:
        """Finished requests' rows become padding: their MoE rows go to no expert and
        count as no expert load (they still ride along in attention, as static shapes
        need)."""
        self.live[rows] = False

    def decode(self, inputs: dict) -> torch.Tensor:
        """A decode step: replayed from the graph of the step's bucket (every rank's is the
        same: the smallest that holds every rank's batch) when the step is an agreed decode
        step, else eager on this rank's own bucket."""
        s = epmoe.current_step()
        if self.graphs is not None and s is not None and s.decode:
            return self.graphs.replay(s.bucket(self.sizes))
        return self.forward(inputs)

    def decode_inputs(self, b: int) -> dict:
        """A decode step's inputs for a bucket of ``b`` rows (views of the fixed tensors)."""
        return dict(
            input_ids=self.step_ids[:b],
            attention_mask=self.step_mask[:b],
            position_ids=self.step_pos[:b],
        )

    def counters(self) -> list[torch.Tensor]:
        """The cache's write positions (one device counter per layer, advanced by every
        forward; transformers' ``StaticLayer.cumulative_length``)."""
        return [layer.cumulative_length for layer in self.cache.layers]


class StepGraphs:
    """This rank's whole decode step in CUDA graphs, one per bucket of ``engine.sizes``:
    embedding, attention on the static KV cache, every MoE block, the logits and the greedy
    tokens of the bucket's b rows.

    Captured on every rank at once (collective: the MoE blocks' warm-up forwards move
    tokens), each inside a decode step of b tokens per rank and ``padded_batch``; all of
    them at the start, largest first. In a decode step every rank replays the graph of the
    step's bucket (agreed: the smallest that holds every rank's batch): a rank with a batch
    on its fixed inputs, an idle rank with no real rows (its MoE blocks send nothing; its
    cache positions are rewound first). The attention then costs the same on every rank,
    so no rank waits in a dispatch for another's host work. After an EPLB re-plan the
    graphs are stale: the bucket a step needs is captured again in that step, on every rank
    (which all replay it), and that step is timed as a ``capture`` step, not a decode
    step. ``timer``'s block events are recorded inside each graph, read after its replays.
    One memory pool serves every graph (one replays at a time).

    On CPU nothing is captured: a capture runs its collective warm-ups and restores the
    step's state as on CUDA, and a replay runs the same forward eagerly, so that the
    steps' protocol (buckets, idle ranks' replays, re-captures after re-plans) runs on
    gloo too."""

    def __init__(self, engine: StaticEngine, blocks: list[EPMoEBlock], group, timer):
        self.engine, self.group, self.timer = engine, group, timer
        self.layers = [b.moe for b in blocks]
        self.cuda = engine.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.graphs: dict[int, tuple] = {}  # b → (graph, next_b, block events, state)
        self.replays = dict.fromkeys(engine.sizes, 0)
        self.idle_replays = self.captures = 0
        if group is not None:  # a step's size is agreed, not the list: it must be everyone's
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, engine.sizes, group=group)
            if any(sizes != engine.sizes for sizes in everyone):
                raise ValueError(
                    f"every rank must capture the same batch sizes (--graph-sizes), got "
                    f"{dict(enumerate(everyone))} by rank"
                )
        for b in sorted(engine.sizes, reverse=True):
            self.capture(b)

    def stale(self, b: int) -> bool:
        """Whether bucket ``b`` has no graph, or one that a re-plan made stale."""
        return b not in self.graphs or graph_state(self.layers) != self.graphs[b][3]

    def capture(self, b: int) -> None:
        """(Re)capture bucket ``b`` (collective: every rank, the same ``b``). Mid-batch too:
        each warm-up forward writes the cache at the position the next step overwrites (its
        write counters are put back before each one and before the capture), and the
        step's inputs are restored afterwards. The warm-ups record no expert load; the
        captured step records it at every replay. On CPU the same, without the graph."""
        e, cuda = self.engine, self.cuda
        if cuda:
            torch.cuda.synchronize()
        ids, live = e.step_ids.clone(), e.live.clone()
        ready = all(getattr(layer, "is_initialized", False) for layer in e.cache.layers)
        written = [int(c) for c in e.counters()] if ready else [0] * len(e.cache.layers)
        graph = next_b = events = None
        try:
            self.timer.relabel("capture")  # (a step that captures is not a decode step)
            e.live.fill_(True)
            with epmoe.step(self.group, num_tokens=b, decode=True, graph_max_tokens=b):
                side = torch.cuda.Stream() if cuda else None
                if cuda:
                    side.wait_stream(torch.cuda.current_stream())
                with (
                    torch.cuda.stream(side) if cuda else contextlib.nullcontext(),
                    load_recording_paused(self.layers),
                ):
                    for _ in range(2):  # compile the kernels, initialise the cache
                        e.forward(e.decode_inputs(b))
                        for c, n in zip(e.counters(), written):
                            c.fill_(n)
                if cuda:
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with (
                        self.timer.capturing() as events,
                        torch.cuda.graph(graph, pool=self.pool),
                    ):
                        next_b = e.forward(e.decode_inputs(b))
        finally:
            e.step_ids.copy_(ids)
            e.live.copy_(live)
        if cuda:
            torch.cuda.synchronize()
        self.graphs[b] = (graph, next_b, events, graph_state(self.layers))
        self.captures += 1

    def replay(self, b: int) -> torch.Tensor:
        """One decode step of the engine's batch on bucket ``b`` (at least its own; captured
        first if stale): the next tokens ``[b]`` (the graph's own tensor, valid until the
        next replay)."""
        if self.stale(b):
            self.capture(b)
        self.replays[b] += 1
        graph, next_b, events, _ = self.graphs[b]
        if not self.cuda:
            return self.engine.forward(self.engine.decode_inputs(b))
        graph.replay()
        self.timer.replayed(events)
        return next_b

    def replay_idle(self, b: int) -> None:
        """This rank's part of a decode step on bucket ``b`` when it has no batch: no real
        rows."""
        for c in self.engine.counters():
            c.zero_()
        self.engine.live.zero_()
        self.idle_replays += 1
        self.replay(b)


def bucket_sizes(R: int) -> list[int]:
    """CUDA-graph batch sizes up to ``R`` rows: 1, 2, 4, ... below ``R``, and ``R``."""
    return [1 << i for i in range(R.bit_length()) if 1 << i < R] + [R]


def rows_of(layer, b: int, R: int):
    """The first ``b`` rows of ``layer``, a transformers ``StaticLayer`` of ``R`` rows
    (``RowsOf``)."""
    return _rows_of_class()(layer, b, R)


@functools.cache
def _rows_of_class() -> type:
    from transformers.cache_utils import StaticLayer

    class RowsOf(StaticLayer):
        """The first ``b`` rows of ``full``, a ``StaticLayer`` of ``R`` rows: a forward of
        ``b`` rows writes and reads views of ``full``'s keys and values and advances
        ``full``'s write counter (the same tensor). If ``full`` is not yet allocated, the
        first forward allocates it at ``R`` rows, from its own head shapes."""

        def __init__(self, full, b: int, R: int) -> None:
            super().__init__(max_cache_len=full.max_cache_len)
            self.full, self.b, self.R = full, b, R

        def lazy_initialization(self, key_states, value_states) -> None:
            full = self.full
            if not full.is_initialized:

                def empty(x):
                    return x.new_empty((self.R, x.shape[1], 0, x.shape[-1]))

                full.lazy_initialization(empty(key_states), empty(value_states))
            own = {"full": full, "b": self.b, "R": self.R}
            vars(self).update(vars(full))  # its shapes, device, write counter (shared) ...
            vars(self).update(own)
            self.keys, self.values = full.keys[: self.b], full.values[: self.b]  # (views)
            self.batch_size = self.b

    return RowsOf


def _cache_argument() -> str:
    """The KV-cache keyword of this transformers' forward (``cache`` from 5.2x on)."""
    import inspect

    from transformers import MixtralForCausalLM

    return (
        "cache"
        if "cache" in inspect.signature(MixtralForCausalLM.forward).parameters
        else ("past_key_values")
    )


_CACHE_ARG = "past_key_values"  # set in main()


def reference_tokens(model, prompt: list[int], n: int, device) -> list[int]:
    """Greedy tokens of one request from the unconverted model (all experts, one process)."""
    ids = torch.tensor([prompt], device=device)
    out = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], 1)
    return out


def idle_forward(blocks: list[EPMoEBlock], hidden_size: int, device, dtype) -> None:
    """A rank with nothing to serve still runs every MoE layer of the step, with 0 tokens."""
    empty = torch.empty(0, hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        for block in blocks:
            block(empty)


def mark(cuda: bool):
    """A point in time: a recorded CUDA event on GPUs (read later, no wait), else the host
    clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed_ms(cuda: bool, a, b) -> float:
    """Milliseconds from mark ``a`` to mark ``b`` (events: once both have completed)."""
    return a.elapsed_time(b) if cuda else (b - a) * 1e3


class StepTimer:
    """The time of every step and of the MoE blocks inside it, by step kind: CUDA events
    on GPUs (read once at the end, so no step waits for the device), the host clock on
    CPU. Forward hooks on the blocks mark their start and end, block graphs' replays
    included; inside a :class:`StepGraphs` capture they record events into the graph,
    read after each of its replays (the step's tokens wait for the device anyway)."""

    def __init__(self, blocks: list[EPMoEBlock], device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.steps: list[tuple[str, object, object, list]] = []
        self._open: tuple[str, object, list] | None = None
        self._captured: list[list] | None = None
        for block in blocks:
            block.register_forward_pre_hook(self._block_start)
            block.register_forward_hook(self._block_end)

    def _mark(self):
        return mark(self.cuda)

    def _ms(self, a, b) -> float:
        return elapsed_ms(self.cuda, a, b)

    def begin(self, kind: str) -> None:
        self._open = (kind, self._mark(), [])

    def relabel(self, kind: str) -> None:
        """The open step (if any) counts as a step of ``kind``."""
        if self._open is not None:
            self._open = (kind, *self._open[1:])

    def end(self) -> None:
        kind, start, blocks = self._open
        self.steps.append((kind, start, self._mark(), blocks))
        self._open = None

    @contextlib.contextmanager
    def capturing(self):
        """Around a CUDA-graph capture: the blocks' events, recorded by each replay."""
        self._captured = events = []
        try:
            yield events
        finally:
            self._captured = None

    def replayed(self, events: list[list]) -> None:
        """A graph holding ``events`` (from :meth:`capturing`) was replayed in this step:
        read them now, before the next replay records them again."""
        if self._open is not None and events:
            events[-1][1].synchronize()
            self._open[2].extend(a.elapsed_time(b) for a, b in events)

    @staticmethod
    def _graph_event():
        """An event recorded into the graph being captured (recorded again by each replay)."""
        event = torch.cuda.Event(enable_timing=True, external=True)
        event.record()
        return event

    def _block_start(self, module, args) -> None:
        if self._captured is not None:
            self._captured.append([self._graph_event(), None])
        elif self._open is not None:
            self._open[2].append([self._mark(), None])

    def _block_end(self, module, args, out) -> None:
        if self._captured is not None:
            self._captured[-1][1] = self._graph_event()
        elif self._open is not None:
            self._open[2][-1][1] = self._mark()

    def summary(self) -> dict[str, tuple[int, float, float]]:
        """Kind → (steps, median step ms, median ms in MoE blocks per step)."""
        if self.cuda:
            torch.cuda.synchronize()
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for kind, start, end, blocks in self.steps:
            moe = sum(b if isinstance(b, float) else self._ms(*b) for b in blocks)
            by_kind.setdefault(kind, []).append((self._ms(start, end), moe))
        out = {}
        for kind, rows in by_kind.items():
            step_ms, moe_ms = zip(*rows)
            out[kind] = (len(rows), statistics.median(step_ms), statistics.median(moe_ms))
        return out


def aligned_moe_ms(
    blocks: list[EPMoEBlock], batch: int, hidden_size: int, device, dtype, group, steps: int
) -> float:
    """Median ms of one pass of ``batch`` random rows per rank through every MoE block, as
    a decode step runs it (its CUDA graphs where captured), with every rank starting
    together (a barrier, and on GPUs a device sync, before each pass): the MoE layers' own
    time, which the served steps' block times exceed by each rank's wait for slower ranks.
    Collective: every rank."""
    cuda = device.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    times = []
    with torch.no_grad():
        for _ in range(steps + 3):  # 3 warm-up passes
            x = torch.randn(batch, hidden_size, generator=g).to(device, dtype)
            if cuda:
                torch.cuda.synchronize(device)
            if group is not None:
                dist.barrier(group=group)
            with epmoe.step(group, num_tokens=batch, decode=True, graph_max_tokens=batch):
                start = mark(cuda)
                for block in blocks:  # (the same rows into each: random layers may blow up)
                    block(x)
                end = mark(cuda)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(elapsed_ms(cuda, start, end))
    return statistics.median(times[3:])


def moe_floor_ms(
    blocks: list[EPMoEBlock], batch: int, hidden_size: int, device, dtype, group, graphs: bool
) -> tuple[float, float, float]:
    """This run's floor under :func:`aligned_moe_ms`: ``(weights_ms, comm_ms, copy_GBps)``,
    the time to read every block's local expert weights at the copy bandwidth measured
    now, and every block's dispatch plus combine of ``batch`` random rows per rank (the
    first block's backend alone: the blocks share one transport; replayed from a CUDA
    graph when ``graphs``, else eager), as the layer benchmark counts them. Collective."""
    from epmoe.bench.comm import measure_dispatch_combine
    from epmoe.bench.common import copy_bandwidth, over_ranks

    barrier = (lambda: dist.barrier(group=group)) if group is not None else None
    timing = dict(warmup=3, iters=10, device=device, barrier=barrier)
    copy_bw = copy_bandwidth(device, timing)
    weight_bytes = sum(
        t.numel() * t.element_size() for b in blocks for t in b.moe.slot_tensors().values()
    )
    moe = blocks[0].moe
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(batch, hidden_size, generator=g).to(device, dtype)
    logits = torch.randn(batch, moe.num_experts, generator=g).to(device)
    with torch.no_grad():
        weights, ids = moe.route(logits)
        times = measure_dispatch_combine(moe.comm, x, ids, weights, timing)
    phases = times["graph"] if graphs and not isinstance(times["graph"], str) else times["eager"]
    comm_ms = over_ranks(sum(phases), device) * len(blocks)
    return weight_bytes / copy_bw * 1e3, comm_ms, copy_bw / 1e9


def percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    v = sorted(values)  # nearest rank: the smallest value with q % of them at or below it
    pick = {q: v[max(math.ceil(q / 100 * len(v)) - 1, 0)] for q in (50, 90, 99)}
    return ", ".join(f"p{q} {x * 1e3:.1f} ms" for q, x in pick.items())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=_at_least(1), default=24, help="requests per rank (±25%%)")
    p.add_argument("--max-batch", type=_at_least(1), default=8, help="requests decoded together")
    p.add_argument(
        "--prefill-chunk", type=_at_least(1), default=16, help="prompt positions per step"
    )
    p.add_argument("--max-prompt", type=_at_least(4), default=40, help="longest prompt (tokens)")
    p.add_argument(
        "--max-new-tokens", type=_at_least(2), default=16, help="longest output (tokens)"
    )
    tiny = "the tiny random model's (without --checkpoint)"
    p.add_argument("--num-layers", type=_at_least(1), default=2, help=f"{tiny} decoder layers")
    p.add_argument("--num-experts", type=_at_least(1), default=8, help=f"{tiny} routed experts")
    p.add_argument("--top-k", type=_at_least(1), default=2, help=f"{tiny} experts per token")
    p.add_argument(
        "--hidden-size", type=_at_least(8), default=64,
        help=f"{tiny} hidden size (a multiple of its 4 attention heads' 2·head_dim: of 8)",
    )  # fmt: skip
    p.add_argument("--vocab", type=_at_least(4), default=512, help=f"{tiny} vocabulary size")
    p.add_argument("--backend", default="auto", help="epmoe all-to-all backend")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the group's)")
    p.add_argument("--rebalance-every", type=_at_least(1), default=20, help="EPLB re-plan interval")
    p.add_argument(
        "--log-every", type=_at_least(1), default=20, help="steps between progress lines"
    )
    p.add_argument(
        "--check",
        type=_at_least(0),
        default=3,
        help="requests per rank compared with the unconverted model",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="serve this Hugging Face checkpoint directory (loaded by shard; e.g. one written "
        "by examples/deepseek_v3_checkpoint.py) instead of a small random Mixtral",
    )
    p.add_argument(
        "--fp8-experts",
        action="store_true",
        help="with --checkpoint: keep the experts of an FP8 checkpoint in FP8 (else dequantised)",
    )
    p.add_argument(
        "--fp8-dispatch",
        action="store_true",
        help="send the rows to the experts' ranks in FP8 (e4m3, a float32 scale per 128 "
        "columns; every backend offers it)",
    )
    p.add_argument(
        "--cuda-graphs",
        nargs="?",
        const="step",
        choices=("step", "blocks"),
        default=None,
        help="replay decode steps from CUDA graphs, one per batch size of --graph-sizes: "
        "'step' (the default) captures the whole decode step (attention on a static KV "
        "cache, MoE blocks, greedy tokens; on CPU: the same path, eagerly); 'blocks' (CUDA) "
        "only the MoE blocks",
    )
    p.add_argument(
        "--graph-sizes",
        type=_sizes,
        default=None,
        help="the batch sizes (rows per rank) of the decode graphs, comma-separated, the "
        "largest --max-batch; a step runs on the smallest that holds every rank's batch "
        "(default: 1, 2, 4, ... below --max-batch, and --max-batch; with --static-cache the "
        "eager forwards pad to them too)",
    )
    p.add_argument(
        "--static-cache",
        action="store_true",
        help="pad batches to a batch size of --graph-sizes and keep the KV cache in a static "
        "cache (what --cuda-graphs step runs, here eagerly)",
    )
    p.add_argument(
        "--aligned-moe-steps",
        type=_at_least(0),
        default=None,
        help="after serving, time this many decode-sized passes through the MoE blocks with "
        "every rank starting together (the blocks' own time, without waiting for ranks "
        "whose attention runs longer); default 20 on CUDA, 0 on CPU (host clock there)",
    )
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        p.error("this example serves a Hugging Face model: pip install 'epmoe[hf]'")
    if args.fp8_experts and not args.checkpoint:
        p.error("--fp8-experts keeps an FP8 checkpoint's experts in FP8: add --checkpoint DIR")
    if args.hidden_size % 8 and not args.checkpoint:  # (4 heads, rotary halves)
        p.error(
            f"--hidden-size must be a multiple of 8 (4 attention heads), got {args.hidden_size}"
        )
    if args.top_k > args.num_experts and not args.checkpoint:
        p.error(f"--top-k {args.top_k} exceeds --num-experts {args.num_experts}")
    if args.graph_sizes is not None and not (args.cuda_graphs or args.static_cache):
        p.error("--graph-sizes applies to --cuda-graphs and --static-cache; add one of them")
    if args.graph_sizes is None:
        args.graph_sizes = bucket_sizes(args.max_batch)
    elif args.graph_sizes[-1] != args.max_batch:
        p.error(
            f"--graph-sizes must end at --max-batch ({args.max_batch}), the largest batch a "
            f"rank decodes; got {','.join(map(str, args.graph_sizes))}"
        )

    group = epmoe.init_distributed()
    rank, W = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    if group is not None:  # the ranks' own collectives follow the options: the same on all
        everyone: list = [None] * W
        dist.all_gather_object(everyone, vars(args), group=group)
        differ = sorted(k for k in vars(args) if len({repr(o[k]) for o in everyone}) > 1)
        if differ:
            p.error(
                "every rank must run with the same options; these differ: "
                + "; ".join(f"--{k.replace('_', '-')}: " + ", ".join(
                    f"rank {r} {o[k]!r}" for r, o in enumerate(everyone)) for k in differ)
            )  # fmt: skip
    device = normalize_device(args.device) if args.device else default_device(group)
    if args.static_cache and args.cuda_graphs == "blocks":
        p.error(
            "--cuda-graphs blocks replays the MoE blocks of unpadded batches; with "
            "--static-cache use --cuda-graphs step (the whole decode step)"
        )
    if args.cuda_graphs == "blocks" and device.type != "cuda":
        p.error(f"--cuda-graphs blocks needs --device cuda (this run is on {device.type})")
    global _CACHE_ARG
    _CACHE_ARG = _cache_argument()
    if args.checkpoint:
        model, reference = load_checkpoint(args, group, rank, device)
    else:
        model = build_model(args, device)
        reference = copy.deepcopy(model) if args.check else None
        replace_moe_blocks(
            model,
            group=group,
            backend=args.backend,
            experts="auto",
            load_window=args.rebalance_every,
            dispatch_dtype=_dispatch_dtype(args),
        )
    dtype = next(model.parameters()).dtype
    args.hidden_size, args.vocab = model.config.hidden_size, model.config.vocab_size
    blocks = [m for m in model.modules() if isinstance(m, EPMoEBlock)]
    E = blocks[0].moe.num_experts
    manager = epmoe.EPLBManager(
        [b.moe for b in blocks],
        num_redundant=(-E) % W + (W if E >= W else 0),  # a spare slot per rank
        rebalance_interval=args.rebalance_every,
    )
    sizes = None  # the MoE blocks' own decode graphs
    if args.cuda_graphs and device.type == "cuda":
        sizes = args.graph_sizes
        if args.cuda_graphs == "step":  # the blocks' graphs only time them aligned, at the end
            sizes = sizes[-1:]
        pool = torch.cuda.graph_pool_handle()  # one pool: the blocks replay one at a time
        for block in blocks:  # collective: every rank, blocks in the same order
            block.capture_decode_graphs(sizes, dtype=dtype, pool=pool)
        if rank == 0:
            print(f"captured decode graphs for batch sizes {sizes} in {len(blocks)} blocks")
    timer = StepTimer(blocks, device)
    queue = make_requests(rank, args)
    if args.static_cache or args.cuda_graphs == "step":
        engine = StaticEngine(model, queue, args, device, dtype)
    else:
        engine = Engine(model, queue, args, device)
    if args.cuda_graphs == "step":  # collective: every rank
        engine.graphs = StepGraphs(engine, blocks, group, timer)
        if rank == 0 and device.type == "cuda":
            print(f"captured the whole decode step in a CUDA graph for batch sizes {engine.sizes}")
        elif rank == 0:
            print(f"the whole decode step for batch sizes {engine.sizes}, on CPU without "
                  "capture (CUDA graphs need CUDA): each replay runs it eagerly")  # fmt: skip
    requests = list(engine.queue)
    start = time.perf_counter()
    steps = tokens = 0
    last_log, last_tokens = start, 0
    while True:
        inputs = engine.next_forward()
        T = 0 if inputs is None else int(inputs["input_ids"].numel())
        # a decode step (idle ranks agree to one) may replay the MoE blocks' graphs
        decode = inputs is None or inputs["kind"] == "decode"
        bound = args.max_batch if args.cuda_graphs else None
        with epmoe.step(group, num_tokens=T, decode=decode, graph_max_tokens=bound) as s:
            if s.max_tokens == 0:  # no rank has tokens: every queue is empty
                break
            timer.begin("idle" if inputs is None else inputs["kind"])
            if inputs is None and engine.graphs is not None and s.decode:
                engine.graphs.replay_idle(s.bucket(engine.sizes))  # as the others do
            elif inputs is None:
                idle_forward(blocks, args.hidden_size, device, dtype)
            else:
                tokens += engine.run(inputs)
            timer.end()
        steps += 1
        if steps % args.log_every == 0:  # (before a re-plan resets the load window)
            total = _sum(tokens, device, group)
            balance, per_rank = _expert_load(blocks, group)  # collective: every rank
            if rank == 0:
                now = time.perf_counter()
                rate = (total - last_tokens) / (now - last_log)
                print(
                    f"[step {steps}] {total} tokens generated, {rate:.0f} tokens/s over "
                    f"{W} rank(s), expert load per rank {per_rank} (rows, layer 0, since "
                    f"the last re-plan), balancedness {balance:.2f}",
                    flush=True,
                )
                last_log, last_tokens = now, total
        report = manager.step()  # collective: every rank, every step
        if rank == 0 and report is not None:
            print(f"[step {steps}] {report.summary()}", flush=True)
        for block in blocks if sizes else ():  # a re-plan moved weights: capture again
            if block.decode_graphs.stale:
                block.decode_graphs.recapture()
    elapsed = time.perf_counter() - start
    aligned_steps = args.aligned_moe_steps
    if aligned_steps is None:
        aligned_steps = 20 if device.type == "cuda" else 0
    aligned = None
    if aligned_steps > 0:  # collective: every rank
        batch = max(sizes) if sizes else args.max_batch
        aligned = aligned_moe_ms(
            blocks, batch, args.hidden_size, device, dtype, group, aligned_steps
        )  # fmt: skip
        floor = moe_floor_ms(blocks, batch, args.hidden_size, device, dtype, group, bool(sizes))

    # every request of every rank: time to first token and inter-token latencies
    mine = [(r.token_times[0] - start, _gaps(r.token_times)) for r in requests if r.token_times]
    checked = mismatched = 0
    for r in requests[: args.check]:  # greedy outputs against the unconverted model
        checked += 1
        mismatched += reference_tokens(reference, r.prompt, len(r.output), device) != r.output
    graph = None  # this rank's (replays by bucket, of them idle, captures) of the step graphs
    if engine.graphs is not None:
        graph = (engine.graphs.replays, engine.graphs.idle_replays, engine.graphs.captures)
    everyone = [None] * W
    if group is not None:
        dist.all_gather_object(
            everyone, (mine, tokens, checked, mismatched, timer.summary(), graph)
        )  # fmt: skip
    else:
        everyone = [(mine, tokens, checked, mismatched, timer.summary(), graph)]
    if rank == 0:
        ttft = [t for m, *_ in everyone for t, _ in m]
        itl = [g for m, *_ in everyone for _, gaps in m for g in gaps]
        total = sum(e[1] for e in everyone)
        print(
            f"served {len(ttft)} requests, {total} tokens in {elapsed:.2f} s over {steps} "
            f"steps on {W} rank(s) ({device.type}): {total / elapsed:.0f} tokens/s, "
            f"{total / elapsed / W:.0f} per rank",
            flush=True,
        )
        for kind in ("prefill", "decode"):  # medians over every rank's steps of that kind
            rows = [e[4][kind] for e in everyone if kind in e[4]]
            if rows:
                n = sum(r[0] for r in rows)
                step_ms = statistics.median(r[1] for r in rows)
                moe_ms = statistics.median(r[2] for r in rows)
                # a rank's MoE time includes its wait in the dispatch for ranks that come
                # later: the rank that waits least shows the blocks' own time best
                lo, hi = min(r[2] for r in rows), max(r[2] for r in rows)
                print(
                    f"{kind} steps: {n} on the {W} rank(s) together, step {step_ms:.2f} ms, "
                    f"MoE blocks {moe_ms:.2f} ms "
                    f"({moe_ms / step_ms:.0%} of the step; medians of the ranks' medians; "
                    f"per rank {lo:.2f}-{hi:.2f} ms)",
                    flush=True,
                )
        print(
            f"time to first token (from the start, queueing included): {percentiles(ttft)}",
            flush=True,
        )
        print(f"inter-token latency: {percentiles(itl)}", flush=True)
        if engine.graphs is not None:  # per rank: (replays by bucket, of them idle, captures)
            by_size = {b: sum(e[5][0][b] for e in everyone) for b in engine.sizes}
            used = {b: n for b, n in by_size.items() if n}
            idle = sum(e[5][1] for e in everyone)
            where = "the step's CUDA graphs" if device.type == "cuda" else "the step (CPU: eager)"
            print(
                f"decode steps replayed from {where} on rank 0: "
                f"{sum(engine.graphs.replays.values())}; on all ranks "
                f"{sum(by_size.values())}, by batch size {used}, "
                f"{idle} of them by idle ranks; captures per rank {[e[5][2] for e in everyone]}",
                flush=True,
            )
        elif sizes:
            replays = sum(b.decode_graphs.replays for b in blocks)
            print(f"MoE block forwards replayed from CUDA graphs on rank 0: {replays}")
        if aligned is not None:
            how = "CUDA graphs" if sizes else "eager"
            print(
                f"MoE blocks with the ranks aligned: {aligned:.2f} ms per decode pass of "
                f"{max(sizes) if sizes else args.max_batch} rows per rank ({how}, "
                f"{len(blocks)} blocks, median of {aligned_steps}; rank 0)",
                flush=True,
            )
            weights_ms, comm_ms, copy_gbps = floor
            print(
                f"floor in this run: reading the blocks' local expert weights {weights_ms:.2f} "
                f"ms (copy {copy_gbps:.0f} GB/s) + their dispatch and combine {comm_ms:.2f} ms "
                f"= {weights_ms + comm_ms:.2f} ms; aligned MoE blocks / floor = "
                f"{aligned / (weights_ms + comm_ms):.2f} (goal <= 1.2)",
                flush=True,
            )
        if args.check:
            n, bad = sum(e[2] for e in everyone), sum(e[3] for e in everyone)
            what = "the checkpoint on one rank" if args.checkpoint else "the unconverted model"
            print(
                f"outputs of {n} requests against {what} (greedy, one process): "
                f"{n - bad} identical, {bad} differ"
                + (
                    " (FP8 dispatch rounds each MoE block's inputs to e4m3: where a random "
                    "model's top logits are close, greedy tokens change)"
                    if args.fp8_dispatch and bad
                    else ""
                ),
                flush=True,
            )
        placement = blocks[0].moe.placement
        slots = [placement.num_local(r) for r in range(W)]
        print(f"layer 0 now: {placement.num_physical} expert slots, per rank {slots}", flush=True)
    if group is not None:
        # let every rank finish with the model's collectives before the group goes
        del engine, manager, blocks, model, reference
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _at_least(lo: int):
    """An argparse type: an int ``>= lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}, got {text!r}")
        return value

    return parse


def _sizes(text: str) -> list[int]:
    """``--graph-sizes``: positive ints, comma-separated → sorted, without repeats."""
    try:
        sizes = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(
            f"expected batch sizes >= 1 separated by commas, e.g. 1,8,32,128; got {text!r}"
        )
    return sizes


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _sum(value: int, device, group) -> int:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _dispatch_dtype(args: argparse.Namespace) -> torch.dtype | None:
    return torch.float8_e4m3fn if args.fp8_dispatch else None


def _expert_load(blocks: list[EPMoEBlock], group) -> tuple[float, list[int]]:
    """Layer 0's recorded expert load (rows its experts computed, from every rank's tokens)
    summed per rank, and its balancedness: mean over max (1.0: perfectly even, or no load).
    Collective."""
    layer = blocks[0].moe
    load = layer.load_recorder.window_load().to(torch.float64)  # [P] this rank's tokens
    if group is not None:
        dist.all_reduce(load, group=group)
    per_rank = measured_rank_load(layer.placement, load)
    return measured_balancedness(layer.placement, load), [int(v) for v in per_rank.tolist()]


if __name__ == "__main__":
    main()
