"""Imported last by the ranks' fork server (``distributed.PRELOAD``): everything the server imported moves to the
garbage collector's permanent generation (``gc.freeze``), so that no collection in a rank walks it again.

A rank starts with the objects of torch, DeepSpeed, transformers and dynamo already in memory, over a million of
them. Without this every full collection in a rank traverses all of them: DeepSpeed's ZeRO-3 calls ``gc.collect()``
each time it builds an engine (``defragment``), and dynamo's tracing allocates enough to trigger collections of its
own. Frozen objects are still freed by reference counting; only the cycle collector skips them, which is what
Python's documentation recommends for a server that forks workers (it also keeps the pages shared)."""
import gc

gc.freeze()
