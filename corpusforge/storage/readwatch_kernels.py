"""readwatch's marks for compiled code: a copy out of a memory map (corpusforge.data.gpt_dataset's gathers) marks
its read in its slot from inside its kernel, because there the read is a page fault, which a hung storage (a Lustre
OST, a CephFS MDS that stopped answering) never answers: the kernel then waits inside a load, with the slot saying
which file, from which offset, since when.

Marking from Python around the kernel cost ~3.7 us a call here (numpy scalar stores, os.getpid, the clock), a
quarter of a warm sample's ~15 us; from inside the kernel, the same stores and CLOCK_MONOTONIC read through the vDSO
cost ~0.1 us. `monotonic_ns()` is time.monotonic_ns() in compiled code (the same clock, so readwatch.current()
compares the two); an intrinsic calling libc's clock_gettime by name rather than a ctypes pointer, which numba
could not cache on disk.

Example:
    >>> slot = readwatch.slot_for("/data/a_text_document.bin")
    >>> t = mark_begin(slot, 4096, 8192, monotonic_ns())       # in a kernel: then a store per piece into
    >>> slot[readwatch.OFFSET] = 12288                          # slot[OFFSET] before each copy, then
    >>> mark_end(slot, t, monotonic_ns())
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from corpusforge.jit import njit
from corpusforge.storage import readwatch

CLOCK_MONOTONIC = 1  # <linux/time.h>: what time.monotonic_ns() reads


@intrinsic
def _clock_monotonic_ns(typingctx):
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), i64.as_pointer()])
        clock_gettime = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
        timespec = cgutils.alloca_once(builder, i64, size=2)  # struct timespec {tv_sec, tv_nsec}: two longs
        builder.call(clock_gettime, [ir.Constant(ir.IntType(32), CLOCK_MONOTONIC), timespec])
        seconds = builder.load(timespec)
        nanoseconds = builder.load(builder.gep(timespec, [ir.Constant(ir.IntType(32), 1)]))
        return builder.add(builder.mul(seconds, ir.Constant(i64, 1_000_000_000)), nanoseconds)

    return types.int64(), codegen


@njit(nogil=True)
def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in nanoseconds, as time.monotonic_ns(), callable from compiled code."""
    return _clock_monotonic_ns()


mark_begin = njit(nogil=True)(readwatch.mark_begin)
mark_end = njit(nogil=True)(readwatch.mark_end)
OFFSET = readwatch.OFFSET
