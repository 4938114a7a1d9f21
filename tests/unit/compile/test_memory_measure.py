# SPDX-License-Identifier: Apache-2.0
"""The benchmark's CPU tensor-memory measurement: known allocations give the known peak (single process).

A test of benchmark code, so one of the two places where the tests import from ``benchmarks/`` (with
``test_benchmark_rounds.py``; nothing under ``benchmarks/`` imports from ``tests/``).
"""
import sys
import threading

import pytest
import torch

from checkout import REPO_ROOT
from machine import unavailable_here

sys.path.insert(0, REPO_ROOT)
from benchmarks.memory import (PAGE_BYTES, MemoryTimeline, _LiveBlocks, live_at_peak,  # noqa: E402
                               live_tensor_bytes, mark, step_peak, trace_memory)

MiB = 1 << 20


def _alloc(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_peak_of_known_allocations():
    with trace_memory() as result:
        with mark("step"):
            a = _alloc(1 * MiB)
            b = _alloc(3 * MiB)
            del a
            c = _alloc(2 * MiB)  # live: 3 + 2 = 5 MiB, below the 1 + 3 + 2 a leak would give
            d = _alloc(1 * MiB)  # peak: 6 MiB
            del b, c, d
    timeline = result["timeline"]
    assert abs(timeline.peak_bytes - 6 * MiB) <= 4 * PAGE_BYTES
    assert abs(timeline.end_bytes) <= 4 * PAGE_BYTES
    step = step_peak(timeline, "step")
    assert step is not None and abs(step.peak_bytes - 6 * MiB) <= 4 * PAGE_BYTES


def test_live_at_peak_names_what_allocated_each_block():
    with trace_memory() as result:
        with mark("step"):
            keep = _alloc(1 * MiB)  # from before the measured step, freed inside it: not counted at the peak
        with mark("step"):
            summed = torch.ones(1 << 18) + 1  # 1 MiB from aten::add (aten::ones' 1 MiB freed at once)
            del keep
            big = torch.zeros(1 << 19).cos()  # peak: 1 + 2 + 2 MiB of add, zeros and cos, then zeros' freed
            product = summed * 2
            del summed, big, product
    step = step_peak(result["timeline"], "step")
    found = {label.split()[0]: (size, count) for label, size, count in live_at_peak(result["timeline"], "step")}
    assert found == {"aten::add": (1 * MiB, 1), "aten::zeros": (2 * MiB, 1), "aten::cos": (2 * MiB, 1)}, found
    assert all(label.endswith("[step]") for label, _, _ in live_at_peak(result["timeline"], "step"))
    assert abs(step.peak_bytes - (5 - 1) * MiB) <= PAGE_BYTES  # above the step's start, which held `keep`


def test_window_rebases_on_a_later_step():
    keep = None
    with trace_memory() as result:
        with mark("step"):
            keep = _alloc(4 * MiB)  # allocated in the first step, still live in the second
        with mark("step"):
            x = _alloc(2 * MiB)
            del x
    del keep
    step = step_peak(result["timeline"], "step")
    assert abs(step.peak_bytes - 2 * MiB) <= PAGE_BYTES
    assert [name for name, _, _ in result["timeline"].marks] == ["step", "step"]


def test_free_on_unwatched_thread_is_recovered_by_address():
    # The profiler does not see frees on other threads (gloo's); an allocation over the same range retires it.
    blocks = _LiveBlocks()
    blocks.alloc(1000, 100)
    blocks.alloc(5000, 50)
    blocks.alloc(1050, 10)  # inside the first block: it must have been freed
    assert blocks.total == 60 and blocks.inferred_frees == 1
    blocks.alloc(4990, 20)  # overlaps the start of the block at 5000
    assert blocks.total == 30 and blocks.inferred_frees == 2
    assert blocks.free(1050) and not blocks.free(1050)


def _expected_live_blocks(ptrs, size):
    """What address matching must conclude when every free is unseen: a block counts as live until a later
    allocation overlaps it. Returns (peak live blocks, blocks retired by overlap)."""
    live, peak, retired = [], 0, 0
    for p in ptrs:
        overlapping = [q for q in live if q < p + size and p < q + size]
        retired += len(overlapping)
        live = [q for q in live if q not in overlapping] + [p]
        peak = max(peak, len(live))
    return peak, retired


def test_thread_free_does_not_inflate_peak_forever():
    """Every free happens on an unwatched thread, so the profiler reports none. The measured peak must be exactly
    what address matching gives for the addresses the allocator actually handed out (recorded here): with no
    address reuse that is all 5 blocks, and each reuse retires one. The trial repeats until the allocator has
    reused an address at least once, so that the measurement is seen to differ from "every free missed"."""
    rounds, size = 5, 2 * MiB
    for _ in range(10):
        ptrs = []
        with trace_memory() as result:
            for _ in range(rounds):
                t = _alloc(size)
                ptrs.append(t.data_ptr())
                worker = threading.Thread(target=lambda box=[t]: box.clear())
                del t
                worker.start()
                worker.join()
        timeline = result["timeline"]
        peak_blocks, retired = _expected_live_blocks(ptrs, size)
        assert timeline.peak_bytes == peak_blocks * size, (timeline.peak_bytes / MiB, ptrs)
        assert timeline.inferred_frees == retired
        if peak_blocks < rounds:
            return
    unavailable_here("allocator_reuse", f"in 10 trials of {rounds} rounds")


def test_window_of_timeline():
    tl = MemoryTimeline(times_s=[0.1, 0.2, 0.3, 0.4], live_bytes=[10, 30, 20, 5], marks=[("step", 0.15, 0.35)])
    w = step_peak(tl, "step")
    assert w.peak_bytes == 20 and w.live_bytes[-1] == 10 and w.times_s[0] == 0.0


def test_census_sees_a_new_tensor():
    before = live_tensor_bytes()
    t = _alloc(8 * MiB)
    after = live_tensor_bytes()
    assert abs(after - before - 8 * MiB) <= PAGE_BYTES
    del t


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
