# SPDX-License-Identifier: Apache-2.0
"""Imported last by the ranks' fork server (``distributed.PRELOAD``): what every rank would otherwise work out again
is done once here, then the server's heap is frozen.

- Inductor's CPU vector ISA probe (``valid_vec_isa_list``: a test build and a child process per ISA, 0.6 s) runs on
  the first inductor compile of each process; its answer, a property of the machine, is cached in the process.
- Everything the server imported moves to the garbage collector's permanent generation (``gc.freeze``), so that no
  collection in a rank walks it again. A rank starts with over a million objects of torch, DeepSpeed, transformers
  and dynamo; without this every full collection traverses them all: DeepSpeed's ZeRO-3 calls ``gc.collect()`` each
  time it builds an engine (``defragment``), and dynamo's tracing allocates enough to trigger collections of its
  own. Frozen objects are still freed by reference counting; only the cycle collector skips them, which is what
  Python's documentation recommends for a server that forks workers (it also keeps the pages shared).

Nothing here may start a thread (the server forks): inductor's pattern-matcher initialization, also lazy, is left to
the ranks because it starts tqdm's monitor thread.
"""
import gc

from torch._inductor.cpu_vec_isa import valid_vec_isa_list

valid_vec_isa_list()
gc.freeze()
