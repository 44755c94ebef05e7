"""``symm_ll``'s Triton kernels on one CPU rank under the Triton interpreter.

The kernels are written for peers over NVLink; with W = 1 the "peer" is this rank's own
buffer, so the interpreter runs every code path of dispatch (metadata, FP8 quantization in
the send kernel, the row index or the copies into ``[e, C, H]``) and combine (weighted
reduction on the expert's side, the sum of partial rows) against the oracle, in CI.
Multi-GPU behaviour (two ranks, graphs, timeouts) is tested in ``tests/gpu/test_symm_ll.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import epmoe
from epmoe.comm.base import FP8_DTYPE, Capabilities, CommSpec, Layout
from epmoe.reference import assert_close, quantize_groups
from tests.unit.symm_sim import assert_interpreted_fp8

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels under TRITON_INTERPRET=1"
)


def _backend(spec, rows_in_place: bool = True):
    from epmoe.comm.symm.ll import SymmLLBackend

    class OnCPU(SymmLLBackend):  # the same kernels, on CPU tensors through the interpreter
        capabilities = Capabilities(
            layouts=frozenset({Layout.EXPERT_BATCHED}),
            dtypes=frozenset({torch.float32, torch.bfloat16}),
            device_types=frozenset({"cpu"}),
            graph_safe=True,
            fp8_dispatch=True,
            max_in_flight=2,
        )

    return OnCPU(spec, None, Layout.EXPERT_BATCHED, rows_in_place=rows_in_place)


def _identity(res):
    """Identity experts' outputs ``[e, C, H]`` (combine's input) of an fp32-wire result."""
    return res.expert_rows()[0].clone()


@pytest.mark.parametrize("in_place", [True, False], ids=["rows in place", "rows copied"])
@pytest.mark.parametrize("split", [False, True], ids=["one launch", "split phase"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32 wire", "fp8 wire"])
@pytest.mark.parametrize(("T", "H"), [(5, 256), (0, 256), (8, 200)], ids=["T=5", "T=0", "H=200"])
def test_dispatch_delivers_every_pair_and_combine_weights_them(fp8, T, H, split, in_place):
    """Both paths: the blocking calls (send and receive fused in one kernel) and the split
    ones (a kernel per half); both designs: received rows read in place through
    ``row_index``, and rows copied into ``[e, C, H]`` slabs."""
    E, K = 8, 3
    placement = epmoe.ExpertPlacement.linear(E, 1)
    spec = CommSpec(
        H, K, placement.rank_offsets, 8, torch.float32, torch.device("cpu"),
        dispatch_dtype=FP8_DTYPE if fp8 else None,
    )  # fmt: skip
    comm = _backend(spec, in_place)
    g = torch.Generator().manual_seed(T + H)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    if T:
        ids[0, 1] = -1  # a token with one slot unused
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    res = comm.dispatch_async(x, ids, w).wait() if split else comm.dispatch(x, ids, w)
    sent = quantize_groups(x) if fp8 else None
    want_x = x
    if fp8:
        q, s = sent
        want_x = (q.float() * s.repeat_interleave(128, -1)[:, :H]).float()
    counts = res.counts.tolist()
    assert counts == [int((ids == e).sum()) for e in range(E)]
    assert (res.row_index is not None) == in_place and res.out_shape == (E, 8, H)
    if in_place:  # the rows where the sender wrote them, nothing else
        assert res.hidden.shape == (8, H) and res.row_index.shape == (E, 8)
    hidden, scale = res.expert_rows()
    arrived = torch.zeros(T, H)  # each token's row as it arrived (dequantized)
    for e in range(E):
        rows = hidden[e, : counts[e]].float()
        if fp8:
            rows = rows * scale[e, : counts[e]].repeat_interleave(128, -1)[:, :H]
        tokens = (ids == e).any(1).nonzero().flatten()
        want = want_x[tokens]
        # each expert's rows are its tokens, in some order: match them up exactly
        order = torch.cdist(rows, want).argmin(1) if len(rows) else torch.empty(0, dtype=int)
        assert sorted(order.tolist()) == list(range(len(want)))
        if fp8:  # the FP8 values and their scales, as the interpreter casts them
            q, s = sent
            assert_interpreted_fp8(hidden[e, : counts[e]], q[tokens][order], f"expert {e}")
            torch.testing.assert_close(scale[e, : counts[e]], s[tokens][order], rtol=0, atol=0)
        else:
            torch.testing.assert_close(rows, want[order], rtol=0, atol=0)
        arrived[tokens[order]] = rows
    # identity experts: combine returns Σ_k w · x over the used slots
    y = hidden.float() * (scale.repeat_interleave(128, -1)[..., :H] if fp8 else 1)
    out = comm.combine_async(y, res).wait() if split else comm.combine(y, res)
    want_out = arrived * (w * (ids >= 0)).sum(1, keepdim=True)
    assert out.shape == (T, H)
    assert_close(out, want_out, 1e-5, name="combine")
    comm.close()


def test_two_in_flight_then_a_third_refused():
    E, K, H = 4, 2, 128
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, 4, torch.float32, "cpu")
    comm = _backend(spec)
    x = torch.randn(3, H)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.full((3, K), 0.5)
    first = comm.dispatch_async(x, ids, w).wait()
    second = comm.dispatch_async(2 * x, ids, w).wait()
    with pytest.raises(RuntimeError, match="at most 2 dispatch results"):
        comm.dispatch_async(x, ids, w)
    torch.testing.assert_close(comm.combine(_identity(first), first), x)
    torch.testing.assert_close(comm.combine(_identity(second), second), 2 * x)
    with pytest.raises(ValueError, match="max_num_tokens"):
        comm.dispatch(torch.randn(5, H), torch.zeros(5, K, dtype=torch.int64), torch.ones(5, K))
    comm.close()


def test_kernels_compile_for_sm90_outside_the_interpreter():
    """The interpreter skips the GPU-only paths (inline PTX for the timer and the acquire
    polls): compile every kernel for sm_90 in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.symm_compile"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled 36 symm kernels" in proc.stdout


def test_bad_ids_and_overflow_are_reported_and_every_token_still_combines():
    """Errors come back from the device (the host word) without a hang: an id past P is
    reported, and duplicated ids that overflow an expert's rows still get their token a
    row back (the source's combine waits for one)."""
    E, K, H, M = 4, 3, 128, 2
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, M, torch.float32, "cpu")
    comm = _backend(spec)
    x = torch.randn(2, H)
    w = torch.full((2, K), 1.0 / K)
    # C = W·M = 2 rows per expert; 6 (token, k) pairs all pick expert 0
    res = comm.dispatch(x, torch.zeros(2, K, dtype=torch.int64), w)
    with pytest.raises(RuntimeError, match="overflowed an expert's rows"):
        comm.combine(_identity(res), res)  # the combine completes, then reports
    # the call completed in step on every rank: reported once, and the transport goes on
    comm.check(sync=False)
    ids = torch.tensor([[0, 1, 2], [1, 2, 3]])
    res = comm.dispatch(x, ids, w)
    torch.testing.assert_close(comm.combine(_identity(res), res), x)
    comm.close()

    comm = _backend(spec)
    res = comm.dispatch(x, torch.tensor([[0, 1, E], [2, -1, 3]]), w)
    with pytest.raises(RuntimeError, match="expert id outside"):
        comm.combine(_identity(res), res)
    comm.close()


def test_a_source_in_another_layers_dispatch_is_named_once_and_the_transport_goes_on():
    """(What a receive writes when a source's call tag is not its own: see the ranks test
    below.) With one rank it is written here: the host names it at the next call."""
    E, K, H = 4, 2, 128
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, 2, torch.float32, "cpu")
    comm = _backend(spec)
    comm.call_tag = 2**40 + 5  # (layer 2**40 + 4: the kernels carry it in 14 bits)
    assert comm.kernel_tag == (2**40 + 4) % 0x3FFF + 1
    x, ids, w = torch.randn(2, H), torch.tensor([[0, 1], [2, 3]]), torch.full((2, K), 0.5)
    res = comm.dispatch(x, ids, w)
    torch.testing.assert_close(comm.combine(_identity(res), res), x)  # one rank: no mismatch
    comm._live().err_host[0] = (4 << 24) | (1 << 16) | 1
    with pytest.raises(
        RuntimeError,
        match=r"symm_ll dispatch on rank 0 met another MoE layer's "
        r"dispatch \(a rank skipped or reordered the step's layers\) on rank 1",
    ):
        comm.dispatch(x, ids, w)
    res = comm.dispatch(x, ids, w)  # reported once
    torch.testing.assert_close(comm.combine(_identity(res), res), x)
    comm.close()


def test_a_timeout_is_reported_over_a_report_the_transport_goes_on_after():
    """The error word keeps the first error, except that a timeout replaces a report the
    host clears (another layer's call, bad ids, an overflow): it is what stops the call's
    other waits early, and what marks the transport broken."""
    from epmoe.comm.symm import kernels as k
    from epmoe.comm.symm.common import status_block
    from tests.unit.symm_report import report_twice

    word = torch.zeros(1, dtype=torch.int32)
    cases = [  # (first, second) -> the kind kept, and the peer of the report kept
        ((k.ERR_LAYER, k.ERR_TIMEOUT), (k.ERR_TIMEOUT, 2)),
        ((k.ERR_CAPACITY, k.ERR_TIMEOUT), (k.ERR_TIMEOUT, 2)),
        ((k.ERR_TIMEOUT, k.ERR_LAYER), (k.ERR_TIMEOUT, 1)),
        ((k.ERR_TIMEOUT, k.ERR_TIMEOUT), (k.ERR_TIMEOUT, 1)),
        ((k.ERR_LAYER, k.ERR_EXPERT_ID), (k.ERR_LAYER, 1)),
    ]
    for (first, second), (kind, peer) in cases:
        word.zero_()
        block = status_block(word, word.device)
        report_twice(block.data_ptr(), first, second)
        assert int(word) == (kind << 24) | (k.OP_DISPATCH << 16) | peer, (first, second)
        # the stop flag that the other waits poll (device memory): raised by a timeout only
        timed_out = k.ERR_TIMEOUT.value in (first.value, second.value)
        assert int(block[1]) == int(timed_out), (first, second)


def test_max_num_tokens_above_what_the_count_word_holds_is_refused():
    from epmoe.comm.symm.ll import SymmLLBackend

    placement = epmoe.ExpertPlacement.linear(4, 1)
    ok = CommSpec(128, 2, placement.rank_offsets, 65534, torch.float32, "cpu")
    assert "count word" not in (SymmLLBackend.supports(ok) or "")  # (CPU: refused for that)
    big = CommSpec(128, 2, placement.rank_offsets, 65535, torch.float32, "cpu")
    assert "max_num_tokens=65535 is above the 65534 tokens" in SymmLLBackend.supports(big)


def test_a_result_combines_once():
    E, K, H = 4, 2, 128
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, 4, torch.float32, "cpu")
    comm = _backend(spec)
    res = comm.dispatch(torch.randn(3, H), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.ones(3, K))
    comm.combine(_identity(res), res)
    with pytest.raises(RuntimeError, match="exactly once"):
        comm.combine(_identity(res), res)
    # ... also once its parity serves a later dispatch: A (parity 0), B (1), C (0 again)
    g = torch.Generator().manual_seed(0)
    # K distinct experts per token: at most M = C rows per expert (no overflow to report)
    mk = lambda T: (  # noqa: E731
        torch.randn(T, H, generator=g), torch.rand(T, E, generator=g).argsort(1)[:, :K],
        torch.ones(T, K),
    )  # fmt: skip
    b = comm.dispatch(*mk(2))
    c = comm.dispatch(*mk(4))
    with pytest.raises(RuntimeError, match="exactly once"):
        comm.combine(_identity(res), res)  # A's handle on C's buffers
    for r in (b, c):
        comm.combine(_identity(r), r)
    comm.close()


def test_closed_backends_and_closed_transports_refuse_calls():
    from epmoe.comm import transport

    E, K, H = 4, 2, 128
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, 4, torch.float32, "cpu")
    args = (torch.randn(2, H), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, K))
    first, second = _backend(spec), _backend(spec)  # one shared transport, two holds
    first.close()
    first.close()  # a second close gives nothing back twice
    with pytest.raises(RuntimeError, match="symm_ll backend is closed"):
        first.dispatch(*args)
    res = second.dispatch(*args)  # the other hold still has its buffers
    second.combine(_identity(res), res)
    transport.close_all()  # e.g. before destroy_process_group
    with pytest.raises(RuntimeError, match="symm_ll backend is closed"):
        second.dispatch(*args)
    second.close()


class _FakeCompiled:
    """What ``kernel[grid](...)`` returns in Triton: its launcher is ``run``."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


# The launcher tests run the GPU path with CPU tensors standing in for the device's: the
# "current device" is theirs, -1 (a tensor on any other device is refused, see below)
CPU = -1


class _FakeKernel:
    """A ``@triton.jit`` function as ``Launcher`` sees it: names, and ``[grid](...)``."""

    arg_names = ["x_ptr", "n", "maybe_ptr", "BLOCK"]

    def __init__(self):
        self.compiled = _FakeCompiled()
        self.plain = []

    def __getitem__(self, grid):
        def call(*args, num_warps, **consts):
            self.plain.append((grid, args, num_warps, consts))
            return self.compiled

        return call


def _direct(monkeypatch, fn, device: list[int]):
    """``fn``'s ``Launcher`` on the direct (GPU) path, as the interpreter never takes it:
    the stream handle faked (7), the current device read from ``device[0]``."""
    from epmoe.kernels import launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "_current_raw_stream", lambda dev=None: 7)
    monkeypatch.setattr(launcher_mod, "_device_index", lambda: device[0])
    launcher = launcher_mod.Launcher(fn)
    launcher.direct = True
    return launcher


def test_launcher_passes_tensors_as_addresses_after_the_first_launch(monkeypatch):
    """The first launch of a specialisation goes through Triton (it compiles); later ones
    call the compiled kernel's launcher directly with each tensor as its address (no
    driver lookup per tensor), other arguments as given and the constexprs in order."""
    from epmoe.kernels import launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "_current_raw_stream", lambda dev=None: 7)
    monkeypatch.setattr(launcher_mod, "_device_index", lambda: CPU)
    fn = _FakeKernel()
    launcher = launcher_mod.Launcher(fn)
    launcher.direct = True  # (the interpreter turns it off: this is the GPU path)
    x = torch.zeros(4)
    launcher((3,), x, 5, None, num_warps=4, BLOCK=16)
    assert len(fn.plain) == 1 and fn.compiled.runs == []
    y = torch.ones(4)  # a new tensor of the same specialisation
    launcher((3,), y, 5, None, num_warps=4, BLOCK=16)
    assert len(fn.plain) == 1
    (run,) = fn.compiled.runs
    assert run[:9] == (3, 1, 1, 7, "function", "metadata", None, None, None)
    assert run[9:] == (y.data_ptr(), 5, None, 16)
    assert type(run[9]) is int


def test_launcher_fills_in_defaults_and_refuses_tensors_as_keywords(monkeypatch):
    """Parameters a call leaves out go to the compiled kernel at their defaults, as Triton's
    own path passes them; a tensor given by keyword (a constexpr of the launch cache: a
    fresh one would miss the cache, and be kept by it, every call) is refused by name."""
    from types import SimpleNamespace

    from epmoe.kernels import launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "_current_raw_stream", lambda dev=None: 7)
    monkeypatch.setattr(launcher_mod, "_device_index", lambda: CPU)
    fn = _FakeKernel()
    fn.arg_names = [*_FakeKernel.arg_names, "ROWS"]
    fn.params = [SimpleNamespace(name="ROWS", has_default=True, default=4)]
    launcher = launcher_mod.Launcher(fn)
    launcher.direct = True
    for _ in range(2):
        launcher((3,), torch.zeros(4), 5, None, num_warps=4, BLOCK=16)
    (run,) = fn.compiled.runs
    assert run[-2:] == (16, 4)
    with pytest.raises(TypeError, match=r"pass \['maybe_ptr'\] positionally"):
        launcher((3,), torch.zeros(4), 5, num_warps=4, maybe_ptr=torch.zeros(1), BLOCK=16)


def test_launcher_refuses_a_tensor_off_the_current_device_before_passing_its_address(
    monkeypatch,
):
    """The direct path passes bare addresses: a CPU tensor, or one on another GPU than the
    current device, would be read as garbage (or fault the device) by a kernel already
    compiled for its dtype and alignment. Such a tensor gets a specialisation of its own,
    and the launch refuses it by name, with the fix, before anything is launched; a bound
    launch refuses it too (returns False)."""

    current = [CPU]
    fn = _FakeKernel()
    launcher = _direct(monkeypatch, fn, current)
    x = torch.zeros(4)
    for _ in range(2):
        launcher((3,), x, 5, None, num_warps=4, BLOCK=16)
    bound = launcher.bind((3,), x, 5, None, variable=(0,), num_warps=4, BLOCK=16)
    assert bound(3, x) is True and len(fn.compiled.runs) == 2
    current[0] = 0  # the CPU tensors are now off the current device (cuda:0)
    with pytest.raises(ValueError, match=r"x_ptr is on cpu, but .* cuda:0: move it to cuda:0"):
        launcher((3,), x, 5, None, num_warps=4, BLOCK=16)
    assert bound(3, x) is False
    current[0] = 1  # a tensor on cuda:0 while cuda:1 is current: named, with the guard
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match=r"torch\.cuda\.device\('cuda:0'\)"):
        launcher((3,), torch.zeros(4), 5, None, num_warps=4, BLOCK=16)
    assert len(fn.plain) == 1 and len(fn.compiled.runs) == 2  # nothing more launched


def test_ints_triton_does_not_specialise_share_one_compiled_launch(monkeypatch):
    """An int declared ``do_not_specialize`` (a row count) keys the launch cache by its
    width only: a count moving between 1, 5 and 16 (other classes for a specialised int)
    launches directly after the first launch, as Triton compiles it once."""
    from types import SimpleNamespace

    fn = _FakeKernel()
    fn.params = [SimpleNamespace(name=n, has_default=False, do_not_specialize=n == "n")
                 for n in _FakeKernel.arg_names]  # fmt: skip
    launcher = _direct(monkeypatch, fn, [CPU])
    for n in (5, 1, 16, 33, 2**40):
        launcher((3,), torch.zeros(4), n, None, num_warps=4, BLOCK=16)
    assert len(fn.plain) == 2  # the first launch, and the first 64-bit count
    assert [run[10] for run in fn.compiled.runs] == [1, 16, 33]


def test_launcher_adds_programmatic_dependent_launch_where_enabled(monkeypatch):
    """A kernel with a ``PDL`` constexpr gets ``PDL=True`` and Triton's ``launch_pdl``
    while a CUDA graph is captured where ``pdl_enabled`` (sm_90+, ``EPMOE_SYMM_PDL`` not
    0), else ``PDL=False`` (eagerly always); kernels without it are launched as before."""
    from epmoe.kernels import launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "_device_index", lambda: CPU)
    for on, capturing, enabled in ((True, True, True), (False, True, False), (True, False, False)):
        monkeypatch.setattr(launcher_mod, "pdl_enabled", lambda index, on=on: on)
        monkeypatch.setattr(launcher_mod, "_capturing", lambda capturing=capturing: capturing)
        fn = _FakeKernel()
        fn.arg_names = [*_FakeKernel.arg_names, "PDL"]
        launcher = launcher_mod.Launcher(fn)
        launcher.direct = launcher.pdl = True  # (the interpreter turns both off)
        launcher((3,), torch.zeros(4), 5, None, num_warps=4, BLOCK=16)
        ((_, _, _, consts),) = fn.plain
        assert consts["PDL"] is enabled and consts.get("launch_pdl", False) is enabled
    plain = _FakeKernel()
    launcher = launcher_mod.Launcher(plain)
    launcher.direct = True
    launcher((3,), torch.zeros(4), 5, None, num_warps=4, BLOCK=16)
    assert "PDL" not in plain.plain[0][3] and "launch_pdl" not in plain.plain[0][3]


def test_a_bound_launch_fills_in_its_variable_arguments_and_refuses_a_new_specialisation(
    monkeypatch,
):
    """``Launcher.bind`` after a launch: the bound launch passes every fixed argument as
    bound and the variable ones as given (tensors as addresses); it launches nothing and
    returns False where a variable argument specialises otherwise (dtype, alignment, an
    int's class, or its width where the kernel does not specialise it), during a capture
    of a kernel with PDL, or on another device; no binding before the first launch, nor
    without the direct path (the interpreter)."""
    from types import SimpleNamespace

    from epmoe.kernels import launcher as launcher_mod

    device = [CPU]
    fn = _FakeKernel()
    launcher = _direct(monkeypatch, fn, device)
    fixed = torch.zeros(4)
    assert (
        launcher.bind((3,), torch.zeros(4), 5, fixed, variable=(0, 1), num_warps=4, BLOCK=16)
        is None
    )
    launcher((3,), torch.zeros(4), 5, fixed, num_warps=4, BLOCK=16)  # compiles
    bound = launcher.bind((3,), torch.zeros(4), 5, fixed, variable=(0, 1), num_warps=4, BLOCK=16)
    assert bound is not None
    y = torch.ones(8)
    assert bound(9, y, 37) is True
    (run,) = fn.compiled.runs
    assert run == (
        9,
        1,
        1,
        7,
        "function",
        "metadata",
        None,
        None,
        None,
        y.data_ptr(),
        37,
        fixed.data_ptr(),
        16,
    )
    assert bound(9, y.to(torch.float64), 37) is False  # another dtype
    assert bound(9, y[1:], 37) is False  # not 16-byte aligned
    assert bound(9, y, 32) is False  # a multiple of 16: another specialisation
    assert bound(9, y, 1) is False
    device[0] = 1
    assert bound(9, y, 37) is False
    assert len(fn.compiled.runs) == 1  # none of those launched
    launcher.direct = False
    assert launcher.bind((3,), y, 5, fixed, variable=(0,), num_warps=4, BLOCK=16) is None
    # a kernel with PDL: bound with PDL off, and not used while a graph is captured
    device[0] = CPU
    capturing = [False]
    monkeypatch.setattr(launcher_mod, "pdl_enabled", lambda index: True)
    monkeypatch.setattr(launcher_mod, "_capturing", lambda: capturing[0])
    fn = _FakeKernel()
    fn.arg_names = [*_FakeKernel.arg_names, "PDL"]
    launcher = launcher_mod.Launcher(fn)
    launcher.direct = launcher.pdl = True
    launcher((3,), y, 5, fixed, num_warps=4, BLOCK=16)
    bound = launcher.bind((3,), y, 5, fixed, variable=(0,), num_warps=4, BLOCK=16)
    assert bound(3, y) is True and fn.compiled.runs[-1][-2:] == (16, False)
    capturing[0] = True
    assert bound(3, y) is False
    assert launcher.bind((3,), y, 5, fixed, variable=(0,), num_warps=4, BLOCK=16) is None
    # an int Triton does not specialise (do_not_specialize): only its width is checked
    capturing[0] = False
    fn = _FakeKernel()
    fn.params = [SimpleNamespace(name=n, has_default=False, do_not_specialize=n == "n")
                 for n in _FakeKernel.arg_names]  # fmt: skip
    launcher = launcher_mod.Launcher(fn)
    launcher.direct = True
    launcher((3,), y, 5, fixed, num_warps=4, BLOCK=16)
    bound = launcher.bind((3,), y, 5, fixed, variable=(0, 1), num_warps=4, BLOCK=16)
    assert bound(3, y, 16) is True and bound(3, y, 1) is True  # (other int classes)
    assert bound(3, y, 2**40) is False  # another width
    with pytest.raises(TypeError, match="takes 2 arguments, got 1"):
        bound(3, y)


def test_bound_launches_run_the_kernels_as_triton_would(monkeypatch):
    """The GPU's direct and bound launch paths (off under the interpreter) run here: each
    launched address is turned back into the tensor it came from (by argument position)
    and the kernel runs under the interpreter. Blocking dispatch and combine with T
    changing (0, 1, M = 16 and between) and the tag changing every call, float32 and FP8
    on the wire, rows in place and copied, match the oracle; after the first calls every
    launch is bound (T and the tag are unspecialised ints: no call refused)."""
    import inspect
    from types import SimpleNamespace

    from epmoe.comm.symm import common
    from epmoe.kernels import launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "_current_raw_stream", lambda dev=None: 0)
    monkeypatch.setattr(launcher_mod, "_capturing", lambda: False)
    k = common.kernels()
    addresses: dict = {}  # (kernel, position, address) -> the tensor launched there
    counts = dict(bound=0, refused=0)

    def remember(name, args, positions=None):
        for i, a in zip(positions or range(len(args)), args):
            if isinstance(a, torch.Tensor):
                addresses[(name, i, a.data_ptr())] = a

    class Compiled:
        function = packed_metadata = "unused"

        def __init__(self, real, n):
            self.real, self.n = real, n

        def run(self, programs, _y, _z, _stream, _f, _m, _a, _b, _c, *values):
            name = self.real.__name__
            args = [addresses.get((name, i, v), v) for i, v in enumerate(values[: self.n])]
            consts = dict(zip(self.real.arg_names[self.n :], values[self.n :]))
            self.real[(programs,)](*args, num_warps=4, **consts)

    # as their @triton.jit(do_not_specialize=...) declare (the interpreter drops it)
    loose = {"ll_dispatch_kernel": {"T", "tag"}, "ll_combine_kernel": {"T"}}
    for real, n in ((k.ll_dispatch_kernel, 29), (k.ll_combine_kernel, 19)):
        name = real.__name__
        signature = inspect.signature(real.fn).parameters.values()
        params = [
            SimpleNamespace(
                name=q.name, has_default=q.default is not inspect.Parameter.empty,
                default=q.default, do_not_specialize=q.name in loose[name],
            )
            for q in signature
        ]  # fmt: skip

        class Proxy:
            __name__, arg_names = name, real.arg_names

            def __init__(self, real, n, params):
                self.real, self.n, self.params = real, n, params

            def __getitem__(self, grid):
                def first(*args, num_warps, **consts):  # Triton's own path: it compiles
                    self.real[grid](*args, num_warps=num_warps, **consts)
                    return Compiled(self.real, self.n)

                return first

        class Launcher(launcher_mod.Launcher):
            def __call__(self, grid, *args, name=name, **kw):
                remember(name, args)
                return super().__call__(grid, *args, **kw)

            def bind(self, grid, *args, name=name, **kw):
                remember(name, args)
                bound = super().bind(grid, *args, **kw)
                return None if bound is None else Bound(name, bound)

        launcher = Launcher(Proxy(real, n, params))
        launcher.direct = launcher.pdl = True
        monkeypatch.setitem(launcher_mod._LAUNCHERS, real, launcher)

    class Bound:
        def __init__(self, name, bound):
            self.name, self.bound = name, bound

        def __call__(self, programs, *variable):
            remember(self.name, variable, self.bound.slots)
            ok = self.bound(programs, *variable)
            counts["bound" if ok else "refused"] += 1
            return ok

    E, K, H, M = 8, 3, 256, 16  # (the receive runs M programs: the interpreter's cost)
    placement = epmoe.ExpertPlacement.linear(E, 1)
    Ts = [5, 7, 3, 9, 16, 1, 1, 2, 0, 13]
    for fp8, in_place in ((False, True), (True, False)):
        spec = CommSpec(H, K, placement.rank_offsets, M, torch.float32, torch.device("cpu"),
                        dispatch_dtype=FP8_DTYPE if fp8 else None)  # fmt: skip
        comm = _backend(spec, in_place)
        counts.update(bound=0, refused=0)
        for step, T in enumerate(Ts):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(T, H, generator=g)
            ids = torch.rand(T, E, generator=g).argsort(1)[:, :K]
            w = torch.softmax(torch.randn(T, K, generator=g), -1)
            comm.call_tag = step + 1
            res = comm.dispatch(x, ids, w)
            assert res.counts.tolist() == [int((ids == e).sum()) for e in range(E)], step
            rows, scale = res.expert_rows()  # identity experts (FP8 rows dequantized)
            y = rows.float() * (scale.repeat_interleave(128, -1)[..., :H] if fp8 else 1)
            out = comm.combine(y, res)
            want = x
            if fp8:
                q, scale = quantize_groups(x)
                want = q.float() * scale.repeat_interleave(128, -1)[:, :H]
            want = want * w.sum(1, keepdim=True)
            assert_close(out, want, 0.1 if fp8 else 1e-5, name=f"fp8={fp8} T={T}")
        # the first call of each parity binds (dispatch and combine): the rest are bound
        assert counts == dict(bound=2 * (len(Ts) - 2), refused=0), counts
        comm.close()


def test_pdl_setting_is_checked_and_off_without_a_gpu(monkeypatch):
    from epmoe.kernels import launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "_PDL", {})
    assert launcher_mod.pdl_enabled(-1) is False
    monkeypatch.setattr(launcher_mod, "_PDL", {})
    monkeypatch.setenv("EPMOE_SYMM_PDL", "yes")
    with pytest.raises(ValueError, match="EPMOE_SYMM_PDL must be 0 or 1"):
        launcher_mod.pdl_enabled(0)


def test_tensors_on_another_device_are_refused_naming_the_argument():
    """The kernels get bare addresses: an input elsewhere than the backend's buffers is an
    error naming the argument and the fix, not garbage read on the GPU."""
    from epmoe.comm.symm.common import _on_device

    _on_device(torch.device("cpu"), hidden_states=torch.zeros(1))
    with pytest.raises(ValueError, match=r"topk_ids is on meta, .* on cpu: .*topk_ids.to\('cpu'\)"):
        _on_device(torch.device("cpu"), topk_ids=torch.zeros(1, device="meta"))


LL_CALLS = {  # tokens per rank in each call: T = 0 on some rank, T = M; at W = 4 three
    # calls (the third on parity 0 again, the other layer's call among them), for time
    2: [(5, 0), (0, 3), (8, 8), (1, 2), (3, 8)],
    4: [(5, 0, 8, 2), (0, 3, 1, 0), (8, 8, 0, 8)],
}


@pytest.mark.parametrize("W", [2, 4], ids=["W=2", "W=4"])
def test_ranks_back_to_back_leave_every_flag_and_counter_as_the_protocol_says(W):
    """W ranks simulated in one process (``symm_sim``), through the split kernels (the bodies
    the fused ones share): five calls (three at W = 4) alternate the parities, with T = 0 on
    some rank, T = M and a token routed nowhere. Each received row is indexed once per
    (token, local expert), combine returns each token's weighted rows, and every flag, count
    and counter the protocol resets is back to 0 for the parity's next call. Each call has
    its own tag (a layer's), and in the third the last rank is in another layer's call:
    every receiver of its rows reports it (``ERR_LAYER``), and nothing else does, and every
    token with an expert across that divide comes back NaN (the others stay right)."""
    import triton.language as tl

    from epmoe.comm.symm import kernels as k
    from tests.unit.symm_sim import Ranks

    sim = Ranks(W)
    M, H, K = sim.M, sim.H, sim.K
    C, e_max = W * M, sim.E // W
    i32 = dict(dtype=torch.int32)
    state = [
        [dict(index=torch.zeros(e_max, C, **i32), counts=torch.zeros(e_max, **i32),
              pos=torch.zeros(W, M, K, **i32), recv_t=torch.zeros(W, **i32))
         for _ in range(2)] for _ in range(W)
    ]  # fmt: skip
    wire = dict(FP8=False, WIRE=tl.float32)
    for n, Ts in enumerate(LL_CALLS[W]):
        parity = n % 2
        reg = sim.regions[parity]
        inputs = [sim.inputs(T) for T in Ts]
        tags = [n + 1] * W
        if n == 2:
            tags[-1] = 99  # the last rank skipped a layer
        for r in range(W):  # dispatch, send half: a program per token
            sim.send(k, parity, r, inputs[r], max(Ts[r], 1), False, tag=tags[r])
        for r in range(W):  # dispatch, receive half: a program per (source, token slot)
            st = state[r][parity]
            k.ll_dispatch_recv_kernel[(W, M)](
                sim.bases, st["index"], st["index"], st["counts"], st["pos"], st["recv_t"],
                sim.err_addr, H, M, W, 1, C, r, 10**9, tags[r], reg.flags, reg.x, reg.s,
                reg.ids, K=K, BLOCK_K=2, BLOCK_H=128, IN_PLACE=True, **wire,
            )  # fmt: skip
            # a source in another layer's call is marked -1 - T_s (its rows combine as NaN)
            marked = [T if tags[s] == tags[r] else -1 - T for s, T in enumerate(Ts)]
            assert st["recv_t"].tolist() == marked, (n, r)
            if n == 2 and r == 0:  # rank 0 (the first to receive) names the last rank
                assert sim.err.item() == (k.ERR_LAYER << 24) | (k.OP_DISPATCH << 16) | (W - 1)
            assert sim.err.item() == 0 or n == 2, (n, r, hex(sim.err.item()))
            lo = r * e_max
            want = [sum(int((inp[1] == lo + e).sum()) for inp in inputs) for e in range(e_max)]
            assert st["counts"].tolist() == want, (n, r)
        sim.err.zero_()  # (each rank's receive reported it: one word here for all ranks)
        for r in range(W):  # combine, send half: identity experts (the rows themselves)
            st = state[r][parity]
            rows = sim.rows(r, parity)[st["index"].long().clamp(min=0)]
            k.ll_combine_send_kernel[(W, M)](
                rows.reshape(e_max * C, H).contiguous(), sim.bases, st["pos"], st["recv_t"],
                st["counts"], e_max, H, M, W, r, reg.flags, reg.w, reg.y,
                K=K, BLOCK_K=2, BLOCK_H=128, BLOCK_E=256,
            )  # fmt: skip
            assert not st["counts"].any(), (n, r)  # zeroed for the parity's next dispatch
        for r in range(W):  # combine, receive half (NaN rows where a peer was in another call)
            sim.combine_receive(k, parity, r, inputs[r], max(Ts[r], 1), False, tags=tags)
        sim.assert_reset(parity, n)


def test_a_closed_backend_keeps_no_view_and_cannot_be_rebound(monkeypatch):
    """``close`` gives back the hold and every cached view of the transport's buffers; a
    ``rebind`` after it is refused (it used to acquire a new transport and serve again).
    ``check()`` waits for the device only on CUDA (it called ``torch.cuda.synchronize()``
    on a CPU transport). An explicit ``rows_in_place`` is not overridden by the setting."""
    E, K, H, M = 4, 2, 128, 4
    spec = CommSpec(H, K, epmoe.ExpertPlacement.linear(E, 1).rank_offsets, M, torch.float32,
                    torch.device("cpu"))  # fmt: skip
    monkeypatch.setenv("EPMOE_SYMM_LL_ROWS", "copy")  # (explicit options win)
    comm = _backend(spec, rows_in_place=True)
    assert comm.rows_in_place
    x, ids, w = torch.randn(2, H), torch.tensor([[0, 1], [2, 3]]), torch.full((2, K), 0.5)
    res = comm.dispatch(x, ids, w)
    comm.combine(_identity(res), res)
    comm.check()  # (sync=True by default)
    comm.close()
    assert comm._views == {} and comm._bound == {}
    for offsets in ((0, 4), (0, 6)):
        with pytest.raises(RuntimeError, match="symm_ll backend is closed"):
            comm.rebind(offsets)
    with pytest.raises(RuntimeError, match="closed"):
        comm.dispatch(x, ids, w)


@pytest.mark.parametrize("raw", ["inf", "nan", "1e10", "0", "-1"])
def test_the_timeout_setting_is_a_finite_positive_number(raw, monkeypatch):
    from epmoe.comm.symm.common import comm_timeout_s

    monkeypatch.setenv("EPMOE_COMM_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="EPMOE_COMM_TIMEOUT_S must be a positive number"):
        comm_timeout_s()


@pytest.mark.parametrize("split", [False, True], ids=["one launch", "split phase"])
def test_the_combine_needs_not_the_callers_ids(split):
    """Two micro-batches through one buffer of ids, refilled for the second after the first
    dispatch: each combine still weights its own tokens' rows (the dispatch keeps each
    token's ranks in the transport; the combine read the caller's ids again, which gave
    errors of 2 here)."""
    E, K, H, M = 4, 2, 128, 4
    spec = CommSpec(H, K, (0, E), M, torch.float32, torch.device("cpu"))
    comm = _backend(spec)
    g = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(3, H, generator=g), torch.randn(3, H, generator=g)
    w = torch.full((3, K), 0.5)
    ids0 = torch.tensor([[0, 1], [2, 3], [1, 2]])
    ids1 = torch.tensor([[3, -1], [-1, -1], [0, 3]])
    ids = ids0.clone()

    def dispatch(x):
        return comm.dispatch_async(x, ids, w).wait() if split else comm.dispatch(x, ids, w)

    def combine(y, res):
        return comm.combine_async(y, res).wait() if split else comm.combine(y, res)

    r0 = dispatch(x0)
    y0 = _identity(r0)
    ids.copy_(ids1)
    r1 = dispatch(x1)
    y1 = _identity(r1)
    for x, y, res, routed in ((x0, y0, r0, ids0), (x1, y1, r1, ids1)):
        want = x * (w * (routed >= 0)).sum(1, keepdim=True)
        assert_close(combine(y, res), want, 1e-6, name=f"split={split}")
    comm.close()


def test_launcher_keys_what_triton_keys(monkeypatch):
    """What a review found the launch cache confusing (latent: no caller does it today):
    constexprs equal in Python but not to Triton (True, 1, 1.0), an int from 2**63 (u64 to
    Triton), a constexpr passed by position (refused by name), a Parameter converted in
    place (the same object at another address and dtype), and a bound slot that is neither
    a tensor nor an int (not bound)."""
    from types import SimpleNamespace

    fn = _FakeKernel()
    fn.params = [SimpleNamespace(name=n, has_default=False, is_constexpr=n == "BLOCK")
                 for n in _FakeKernel.arg_names]  # fmt: skip
    launcher = _direct(monkeypatch, fn, [CPU])
    x = torch.zeros(4)
    for block in (True, 1, 1.0, True):
        launcher((3,), x, 5, None, num_warps=4, BLOCK=block)
    assert [c["BLOCK"] for *_, c in fn.plain] == [True, 1, 1.0]  # three kernels, then reuse
    for n in (2**62, 2**63, 2**63 + 16):
        launcher((3,), x, n, None, num_warps=4, BLOCK=16)
    assert [args[1] for _, args, *_ in fn.plain[3:]] == [2**62, 2**63]  # i64, then u64
    with pytest.raises(TypeError, match=r"pass the constexprs \['BLOCK'\] by keyword"):
        launcher((3,), x, 7, None, 32, num_warps=4)
    w = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16), requires_grad=False)
    launcher((3,), w, 5, None, num_warps=4, BLOCK=16)
    w.data = torch.zeros(8, dtype=torch.float32)  # what Module.to(torch.float32) does
    plain = len(fn.plain)
    launcher((3,), w, 5, None, num_warps=4, BLOCK=16)
    assert len(fn.plain) == plain + 1 and fn.plain[-1][1][0].dtype == torch.float32
    assert launcher.bind((3,), x, 5, None, variable=(2,), num_warps=4, BLOCK=16) is None
    assert launcher.bind((3,), x, 5, None, variable=(0,), num_warps=4, BLOCK=16) is not None
