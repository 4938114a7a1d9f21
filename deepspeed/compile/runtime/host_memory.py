# SPDX-License-Identifier: Apache-2.0
"""The host memory a step freed, handed back to the OS before the optimizer step (``compile.release_host_memory``).

[Note: host memory after backward] On CPU every gathered parameter, activation and gradient bucket of a step is
allocated through the C library's allocator. glibc serves blocks under its mmap threshold (32 MiB at most) from its
heaps, and keeps what they free there, resident, for the next allocation: after backward the heaps hold about the
step's gathered parameters, free. The optimizer step that follows allocates its temporaries (Adam's ``sqrt`` and
``div`` of a flat ZeRO partition, each the partition's size) above the threshold, as fresh mappings that cannot
reuse the heaps. So the process's resident memory peaked at the heaps' free memory plus those temporaries.
``malloc_trim(0)`` at the end of a backward that ends a gradient-accumulation cycle hands every free page of the
heaps back to the OS (``madvise(MADV_DONTNEED)``): the optimizer's temporaries then take the place of the step's
freed memory instead of adding to it, and the next forward takes pages from the OS again as it gathers.
"""
import ctypes
import os
import time
from typing import Callable, Optional

import torch


def malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS) or cannot be opened."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``), 0 where the OS does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HostHeap:
    """Returns the allocator's free memory to the OS at the end of each backward that ends a gradient-accumulation
    cycle (:meth:`release`), and counts what that did for ``engine_report``. Off (``trim`` None) it does nothing."""

    def __init__(self, trim: Optional[Callable[[int], int]] = None):
        self._trim = trim
        self.reset_counters()

    def reset_counters(self) -> None:
        self.releases = 0
        self.released_bytes = 0  # resident memory before each release less after it, summed
        self.seconds = 0.0

    @classmethod
    def for_setting(cls, setting, device) -> "HostHeap":
        """``compile.release_host_memory``: ``"auto"`` releases where the parameters live on the CPU (the step's
        gathered memory is the host's), True wherever they live, False never. Where the C library has no
        ``malloc_trim`` it is off (``engine.compile()`` refuses True there: ``engine_state.check_compile_request``)."""
        trim = malloc_trim()
        on = setting is True or (setting == "auto" and torch.device(device).type == "cpu")
        return cls(trim if on else None)

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def release(self) -> None:
        if self._trim is None:
            return
        before, start = resident_bytes(), time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - start
        self.released_bytes += max(0, before - resident_bytes())
        self.releases += 1

    def report_items(self) -> dict:
        return {
            "host_memory_releases": self.releases,
            "host_memory_released_bytes": self.released_bytes,
            "host_memory_release_seconds": self.seconds,
        }
