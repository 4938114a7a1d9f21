# SPDX-License-Identifier: Apache-2.0
"""``compile.release_host_memory`` (``runtime/host_memory.py``): the allocator's free memory handed back to the OS
before the optimizer step. Here, in one process: what the setting turns on where, that a release takes the resident
memory the heaps held free off the process, and that ``true`` is refused, naming the key, where the C library has no
``malloc_trim``. How often it runs in training (once per optimizer step, at every stage) is checked by the parity
tests (``test_pipeline.py``, gradient accumulation; ``test_zero12.py``)."""
import pytest
import torch

from machine import unavailable_here


def test_the_setting_turns_it_on_where_the_parameters_live_on_the_cpu():
    from deepspeed.compile.runtime.host_memory import HostHeap, malloc_trim
    if malloc_trim() is None:
        unavailable_here("malloc_trim", "the setting is off everywhere")
    assert HostHeap.for_setting("auto", "cpu").enabled
    assert not HostHeap.for_setting("auto", "cuda:0").enabled  # the step's gathered memory is the device's
    assert HostHeap.for_setting(True, "cuda:0").enabled  # the host memory of CPU offload
    assert not HostHeap.for_setting(False, "cpu").enabled
    off = HostHeap.for_setting(False, "cpu")
    off.release()
    assert off.releases == 0


def test_a_release_hands_the_heaps_free_memory_back():
    """Tensors of 64 KiB come from glibc's heaps (under its mmap threshold); every other one freed leaves free
    memory between live blocks, which the allocator keeps resident (nothing at the heap's top to trim on free). A
    release hands most of it back."""
    from deepspeed.compile.runtime.host_memory import HostHeap, malloc_trim, resident_bytes
    trim = malloc_trim()
    if trim is None or resident_bytes() == 0:
        unavailable_here("malloc_trim")
    count, numel = 4096, 16 * 1024  # 4096 blocks of 64 KiB: 256 MiB, half of it freed
    blocks = [torch.ones(numel) for _ in range(count)]
    del blocks[::2]
    freed = count // 2 * numel * 4
    heap = HostHeap(trim)
    before = resident_bytes()
    heap.release()
    assert heap.releases == 1 and heap.seconds > 0
    assert heap.released_bytes >= freed // 2, (heap.released_bytes, freed)
    assert before - resident_bytes() >= freed // 2, (before, resident_bytes(), freed)
    assert all(float(b[-1]) == 1.0 for b in blocks)  # the live blocks are untouched
    heap.reset_counters()
    assert (heap.releases, heap.released_bytes, heap.seconds) == (0, 0, 0.0)


def test_true_without_malloc_trim_is_refused_naming_the_key(monkeypatch):
    from deepspeed.compile.config import CompileConfig
    from deepspeed.compile.engine_state import check_compile_request
    from deepspeed.compile.runtime import host_memory
    monkeypatch.setattr(host_memory, "malloc_trim", lambda: None)
    with pytest.raises(ValueError, match="release_host_memory"):
        check_compile_request(CompileConfig(deepcompile=True, release_host_memory=True), "eager", None)
    check_compile_request(CompileConfig(deepcompile=True), "eager", None)  # "auto" is then off, not an error
    assert not host_memory.HostHeap.for_setting("auto", "cpu").enabled
    with pytest.raises(ValueError, match="release_host_memory"):
        CompileConfig(deepcompile=True, release_host_memory="sometimes")
