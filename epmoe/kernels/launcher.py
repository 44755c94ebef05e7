"""Launch Triton kernels with little host overhead: ``launch(fn)`` and its bound launches.

``kernel[grid](...)`` costs 20-26 µs of host time per call on an H200 host (Triton binds
and specialises every argument again each time); an eager decode step launches a dozen
kernels, so that is most of its host time. ``Launcher`` keeps each compiled kernel and
calls its launcher directly (17 µs); ``BoundLaunch`` keeps all the arguments of a launch
but a few, which each call fills in (7.5 µs; docs/benchmarks.md). The symm backends and
the layer's routing and recording kernels launch through it. Importing this module
compiles nothing and touches no device.
"""

from __future__ import annotations

import os
import warnings

import torch

_LAUNCHERS: dict[object, Launcher] = {}


def launch(fn) -> Launcher:
    """The launcher of the ``@triton.jit`` function ``fn`` (one per function, made on first
    use)."""
    launcher = _LAUNCHERS.get(fn)
    if launcher is None:
        launcher = _LAUNCHERS[fn] = Launcher(fn)
    return launcher


def interpreted(fn) -> bool:
    """Whether the ``@triton.jit`` function ``fn`` was built for the Triton interpreter
    (``TRITON_INTERPRET=1`` when its module was imported: it runs on CPU tensors)."""
    return type(fn).__name__ == "InterpretedFunction"


def check_cuda(what: str, device: torch.device, fn) -> None:
    """Raise, naming ``what`` and the fix, unless ``device`` is CUDA or ``fn`` (a
    ``@triton.jit`` function) was built for the Triton interpreter (CPU tensors)."""
    if device.type != "cuda" and not interpreted(fn):
        raise RuntimeError(
            f"{what} runs on CUDA tensors, got {device}: move them to a GPU, or set "
            "TRITON_INTERPRET=1 before epmoe.kernels is imported (slow; for tests)"
        )


def _specialization(a):
    """What Triton compiles ``a`` (a kernel argument) for, beyond constexprs; for a tensor
    also its CUDA device index (-1 on the CPU), which the launch checks against the current
    device before a tensor's address is ever passed as it is."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0, a.get_device()
    if type(a) is int:
        return a == 1, a & 15 == 0, _int_width(a)
    return a


_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})  # (a type test at C speed)


def _int_width(a: int) -> str:
    """The type Triton gives an int argument: ``i32``, ``i64`` or ``u64`` (from 2⁶³)."""
    if -(2**31) <= a < 2**31:
        return "i32"
    return "u64" if a >= 2**63 else "i64"


def _device_index() -> int:
    try:
        return torch._C._cuda_getDevice()
    except (AttributeError, RuntimeError):  # no CUDA (the interpreter)
        return -1


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (a C call)."""
    try:
        return torch._C._cuda_isCurrentStreamCapturing()
    except (AttributeError, RuntimeError):  # another torch, or no CUDA
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _current_raw_stream(dev: int | None = None) -> int:
    """The current CUDA stream's handle on device ``dev`` (the current device if None), as
    Triton's own launcher reads it (a C call; ``torch.cuda.current_stream()`` costs several
    µs of Python per launch)."""
    try:
        return torch._C._cuda_getCurrentRawStream(
            torch._C._cuda_getDevice() if dev is None else dev
        )
    except AttributeError:  # another torch: the public path
        return torch.cuda.current_stream().cuda_stream


_PDL: dict[int, bool] = {}


def pdl_enabled(device_index: int) -> bool:
    """Whether the symm kernels captured into CUDA graphs launch with programmatic
    dependent launch on this device: sm_90 or newer, unless ``EPMOE_SYMM_PDL=0``. A kernel
    so launched may start while the kernel before it on the stream finishes (each program
    waits for it first, see ``kernels._after_prior``), which takes 0.2-0.7 µs off each
    phase of a replayed decode graph (docs/benchmarks.md). Eager launches never use it:
    there the host sets the pace, and one eager run with it stalled (6.6 ms per phase at
    512 tokens, not understood), so it stays where it was measured to help."""
    enabled = _PDL.get(device_index)
    if enabled is None:
        raw = os.environ.get("EPMOE_SYMM_PDL", "1").strip() or "1"
        if raw not in ("0", "1"):
            raise ValueError(f"EPMOE_SYMM_PDL must be 0 or 1, got {raw!r}")
        enabled = raw == "1" and device_index >= 0
        if enabled:
            enabled = torch.cuda.get_device_capability(device_index)[0] >= 9
        _PDL[device_index] = enabled
    return enabled


class Launcher:
    """Launch one Triton kernel with little host overhead.

    ``kernel[grid](...)`` re-binds and re-specialises every argument on every call, which
    costs tens of µs of host time per launch: more than the transfer itself at decode sizes.
    The first launch for a specialisation (constexprs, pointer alignment, small-int
    flags) goes through Triton and keeps the compiled kernel; later ones call its launcher
    directly, with each tensor passed as its address: given a tensor, Triton's launcher
    calls its ``data_ptr`` and then asks the driver which device address it maps to
    (``cuPointerGetAttribute``, once per tensor argument and launch), where an address
    goes straight through. The callers check that every tensor is on the kernel's device
    (``_on_device``). Any surprise from the launcher's interface falls back to the plain
    path.

    It keeps the previous launch's arguments, so that those passed again (the same objects)
    are not looked at again; that keeps the caller's tensors alive until the next launch.
    Right for kernels whose arguments are mostly long-lived buffers (the symm backends',
    routing, recording); the expert GEMMs, with about 30 arguments, many of them fresh
    intermediates, were slower through it than through ``kernel[grid]`` (docs/benchmarks.md)
    and keep Triton's path.
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.names = fn.arg_names
        # trailing parameters a call may leave out, as Triton's own path fills them in
        self.defaults = {p.name: p.default for p in getattr(fn, "params", ()) if p.has_default}
        self.compiled: dict[tuple, object] = {}
        # positions of the ints Triton does not specialise on (beyond their width): a bound
        # launch checks only that (a count changing from 15 to 16 rows keeps its binding)
        self.unspecialized = {
            i
            for i, p in enumerate(getattr(fn, "params", ()))
            if getattr(p, "do_not_specialize", False)
        }
        # constexprs are keyed by value as keywords; passed by position they would be keyed
        # as ints (refused at their first launch, see _check_new)
        self.constexprs = {
            i for i, p in enumerate(getattr(fn, "params", ())) if getattr(p, "is_constexpr", False)
        }
        self.direct = os.environ.get("TRITON_INTERPRET", "0") != "1"
        self.pdl = self.direct and "PDL" in self.names  # see pdl_enabled
        # the previous launch's args, their parts and their tensors' addresses
        self._memo: tuple[tuple, tuple, list] | None = None

    def __call__(self, grid: tuple[int, ...], *args, num_warps: int, **consts) -> None:
        num_warps_and = dict(num_warps=num_warps)
        dev = _device_index()
        if self.pdl:
            consts["PDL"] = pdl = pdl_enabled(dev) and _capturing()
            if pdl:
                num_warps_and["launch_pdl"] = True
        if not self.direct:
            self.fn[grid](*args, **num_warps_and, **consts)
            return
        # what Triton specialises a compiled kernel on: pointer dtype and 16-byte alignment,
        # int width and the values 1 and multiples of 16 (constexprs by value), and the
        # device (a compiled kernel is loaded per device). Most arguments are the same
        # objects as in the previous launch (the transport's buffers, sizes, offsets): their
        # part is reused, only new objects (the caller's inputs) are looked at again
        # (a memo of the last two calls would skip the parity-alternating buffers too, 3 µs
        # of a round trip on a CPU core, but would keep the caller's tensors a call longer)
        # (a tensor is the same only at the same address: a Parameter converted by
        # Module.to() is the same object holding other data, of another dtype)
        # (list comprehensions, C-level type tests: this is an eager call's host time)
        memo = self._memo
        ptrs = [a.data_ptr() if type(a) in _TENSOR_TYPES else None for a in args]
        if memo is not None and len(memo[0]) == len(args):
            old_args, old_parts, old_ptrs = memo
            parts = tuple(
                [
                    old_parts[i] if a is old_args[i] and p == old_ptrs[i] else self._part(i, a)
                    for i, (a, p) in enumerate(zip(args, ptrs))
                ]
            )
        else:
            parts = self._parts(args)
        self._memo = (args, parts, ptrs)
        key = _cache_key(dev, num_warps, consts, parts)
        kernel = self.compiled.get(key)
        if kernel is None:
            self._check_new(args, parts, consts, dev)
            self.compiled[key] = self.fn[grid](*args, **num_warps_and, **consts)
            return
        try:
            values = self._values(args, consts, ptrs)
            stream = _current_raw_stream(dev)
            g = (*grid, 1, 1)
            kernel.run(
                g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                None, None, None, *values,
            )  # fmt: skip
        except TypeError as exc:  # another Triton launcher interface: keep the plain path
            self.direct = False
            warnings.warn(
                f"epmoe: launching {getattr(self.fn, '__name__', self.fn)} through Triton's "
                f"plain path from now on (its direct launcher refused the call: {exc}); eager "
                "calls get slower",
                RuntimeWarning,
                stacklevel=2,
            )
            self.fn[grid](*args, **num_warps_and, **consts)

    def _part(self, i: int, a):
        """Argument ``i``'s part of the cache key: an int Triton does not specialise on
        (``do_not_specialize``) by its width only, else ``_specialization``."""
        if type(a) is int and i in self.unspecialized:
            return _WIDTH, _int_width(a)
        return _specialization(a)

    def _parts(self, args: tuple) -> tuple:
        return tuple(self._part(i, a) for i, a in enumerate(args))

    def _check_new(self, args: tuple, parts: tuple, consts: dict, dev: int) -> None:
        """Before a new specialisation is launched and kept: a tensor given as a keyword
        (a constexpr of the cache key: a fresh one would miss, and be kept, every call), or
        a tensor elsewhere than on the current CUDA device (a later launch would pass its
        address as it is: a CPU tensor's, or another GPU's, read as garbage or a fault),
        is refused, by name."""
        name = getattr(self.fn, "__name__", self.fn)
        positional = [self.names[i] for i in sorted(self.constexprs) if i < len(args)]
        if positional:
            raise TypeError(
                f"{name}: pass the constexprs {positional} by keyword (a launch is keyed on "
                "their values as keywords)"
            )
        tensors = [n for n, value in consts.items() if isinstance(value, torch.Tensor)]
        if tensors:
            raise TypeError(
                f"{name}: pass {tensors} positionally (keyword arguments are compile-time "
                "constants of the launch cache)"
            )
        for i, (a, part) in enumerate(zip(args, parts)):
            if isinstance(a, torch.Tensor) and part[2] != dev:
                arg = self.names[i] if i < len(self.names) else f"argument {i}"
                fix = (
                    f"move it to cuda:{dev}"
                    if part[2] < 0
                    else f"call it under torch.cuda.device({str(a.device)!r}), or move it to "
                    f"cuda:{dev}"
                )
                raise ValueError(
                    f"{name}: {arg} is on {a.device}, but the kernel runs on the current CUDA "
                    f"device, cuda:{dev}: {fix}"
                )

    def _values(self, args: tuple, consts: dict, ptrs: list | None = None) -> list:
        """The compiled kernel's arguments: each tensor as its address (``ptrs``: the
        tensors' addresses, None elsewhere, when the caller has them), the other arguments
        as given, then the constexprs in order (defaults where not given)."""
        if ptrs is None:
            ptrs = [a.data_ptr() if type(a) in _TENSOR_TYPES else None for a in args]
        values = [a if p is None else p for a, p in zip(args, ptrs)]
        values += [consts[n] if n in consts else self.defaults[n] for n in self.names[len(args) :]]
        return values

    def bind(
        self, grid: tuple[int, ...], *args, variable: tuple[int, ...], num_warps: int, **consts
    ) -> BoundLaunch | None:
        """The launch ``self(grid, *args, num_warps=..., **consts)`` with every argument but
        those at positions ``variable`` fixed (see ``BoundLaunch``), or ``None`` where it cannot be
        bound: no direct path (the interpreter), no compiled kernel for these arguments yet
        (launch them once first), a grid of more than one dimension, or inside a CUDA-graph
        capture of a kernel with ``PDL``."""
        if not self.direct or len(grid) != 1:
            return None
        if any(type(args[i]) not in (torch.Tensor, int) for i in variable):
            return None  # (a bound slot is re-checked as a tensor or an int only)
        dev = _device_index()
        if self.pdl:
            if pdl_enabled(dev) and _capturing():
                return None
            consts["PDL"] = False
        parts = self._parts(args)
        kernel = self.compiled.get(_cache_key(dev, num_warps, consts, parts))
        if kernel is None:
            return None
        values = self._values(args, consts)
        return BoundLaunch(kernel, values, variable, [parts[i] for i in variable], dev, self.pdl)


def _cache_key(dev: int, num_warps: int, consts: dict, parts: tuple) -> tuple:
    """A compiled kernel's key in ``Launcher.compiled`` (launches and bindings alike)."""
    # (with the values' types: True, 1 and 1.0 are equal keys in Python, not to Triton)
    return dev, num_warps, tuple(consts.items()), tuple(map(type, consts.values())), parts


_WIDTH = "int width"  # a bound int argument's check: only its width (_int_width)


class BoundLaunch:
    """One kernel's launch with its arguments bound but a few: a backend binds its fused
    dispatch and combine once per parity (the transport's buffers, sizes and offsets), and
    each call fills in only the caller's tensors and counts. Launching through it cost
    7.5 µs of host time against 17 through ``Launcher`` on one H200 (docs/benchmarks.md):
    what an eager decode step waits for. A call returns ``False``, launching nothing,
    where an argument no longer specialises as when bound (a tensor's dtype, 16-byte
    alignment or device, an int's class, or only its width where Triton does not specialise
    it), on another current device, or during a capture of a kernel with ``PDL``: the
    caller then launches through ``Launcher`` (and may bind again)."""

    __slots__ = ("kernel", "values", "slots", "parts", "dev", "pdl")

    def __init__(self, kernel, values, slots, parts, dev: int, pdl: bool) -> None:
        self.kernel, self.values, self.slots, self.parts = kernel, values, slots, parts
        self.dev, self.pdl = dev, pdl

    def __call__(self, programs: int, *variable) -> bool:
        """Launch ``programs`` programs with ``variable`` at the bound positions."""
        if len(variable) != len(self.slots):
            raise TypeError(
                f"a bound launch takes {len(self.slots)} arguments, got {len(variable)}"
            )
        if (self.pdl and _capturing()) or _device_index() != self.dev:
            return False
        values = self.values
        for slot, part, a in zip(self.slots, self.parts, variable):
            if type(a) is torch.Tensor:
                if a.dtype is not part[0] or a.get_device() != part[2]:  # (dtypes: singletons)
                    return False
                a = a.data_ptr()
                if (not a & 15) is not part[1]:
                    return False
            elif part[0] is _WIDTH:
                if type(a) is not int or _int_width(a) != part[1]:
                    return False
            elif _specialization(a) != part:
                return False
            values[slot] = a
        k = self.kernel
        try:
            k.run(
                programs, 1, 1, _current_raw_stream(self.dev), k.function, k.packed_metadata,
                None, None, None, *values,
            )  # fmt: skip
        except TypeError:  # another launcher interface (refused before launching): the
            return False  # caller's path through Launcher handles it
        return True
