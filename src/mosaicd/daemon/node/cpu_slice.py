"""The CPU slice a node's training thread gets from the kernel before it is switched for another runnable thread.

Where a host runs more node processes than it has cores (`mosaicd cluster`: 16 nodes on 2 cores), every core
time-shares ~8 trainers. Linux's EEVDF scheduler gives each a slice of ~0.75 ms x (1 + log2(cores)) and then
switches, so one round's training (~25 ms of the tutorial job's CNN) is cut into many pieces, each starting
with caches and branch predictors that the other trainers have just used. Since Linux 6.12 a thread may ask for
a longer slice of its own (`sched_setattr`'s `sched_runtime` for SCHED_OTHER, 0.1 to 100 ms): the trainer then
runs its round in fewer pieces, the event loops keep the kernel's short slice (and with it their quick wake-up).
The models do not depend on it: only when, and how long, the kernel lets each thread run.

`train_slice_ms` (settings) is that slice; 0 leaves the kernel's. Where the kernel or platform cannot set it
(not Linux, older than 6.12, a seccomp filter), nothing changes and the node says so once in its log.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "arm64": 274}  # the system call's number per architecture
SCHED_GETATTR = {"x86_64": 315, "aarch64": 275, "arm64": 275}
ATTR = struct.Struct("=IIQiIQQQII")  # struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes)
MAX_SLICE_MS = 100.0  # the kernel clamps a custom slice to 0.1-100 ms

_local = threading.local()


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def set_slice(ms: float, tid: int = 0) -> bool:
    """Ask the kernel for a slice of `ms` milliseconds for thread `tid` (0: the calling thread), keeping its
    policy (SCHED_OTHER or SCHED_BATCH) and nice value; False where it cannot be set."""
    number = SCHED_SETATTR.get(platform.machine())
    if number is None or not hasattr(os, "sched_getscheduler"):
        return False
    try:
        policy = os.sched_getscheduler(tid)
        nice = os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())
    except OSError:
        return False
    if policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return False
    attr = ATTR.pack(ATTR.size, policy, 0, nice, 0, int(ms * 1_000_000), 0, 0, 0, 0)
    return _libc().syscall(number, tid, ctypes.c_char_p(attr), 0) == 0


def get_slice_ms(tid: int = 0) -> float | None:
    """The slice the kernel keeps for thread `tid` (0: the calling thread), in ms; None where it cannot be read."""
    number = SCHED_GETATTR.get(platform.machine())
    if number is None:
        return None
    buf = ctypes.create_string_buffer(ATTR.size)
    if _libc().syscall(number, tid, buf, ATTR.size, 0) != 0:
        return None
    return ATTR.unpack(buf.raw)[5] / 1_000_000


def sliced(fn: Callable[..., T], ms: float, on_set: Callable[[float | None], None] | None = None) -> Callable[..., T]:
    """`fn`, run with the calling thread's slice set to `ms` first (once per thread: worker threads are reused);
    `on_set` is told, each time, the slice the kernel then keeps (None: it could not be set)."""
    if ms <= 0:
        return fn

    def call(*args: Any, **kwargs: Any) -> T:
        if getattr(_local, "slice_ms", None) != ms:
            _local.slice_ms = ms
            got = get_slice_ms() if set_slice(ms) else None
            if on_set is not None:
                on_set(got)
        return fn(*args, **kwargs)

    return call
