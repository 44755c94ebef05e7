"""A kernel that reports two errors in a row, for ``kernels._report``'s precedence
(imported by the interpreter tests only: it imports Triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from epmoe.comm.symm import kernels as k


@triton.jit
def report_twice_kernel(err_addr, FIRST: tl.constexpr, SECOND: tl.constexpr):
    """Kind ``FIRST`` naming rank 1, then ``SECOND`` naming rank 2."""
    k._report(err_addr, FIRST, k.OP_DISPATCH, 1)
    k._report(err_addr, SECOND, k.OP_DISPATCH, 2)


def report_twice(err_addr: int, first: int, second: int) -> None:
    report_twice_kernel[(1,)](err_addr, FIRST=first, SECOND=second)
