# SPDX-License-Identifier: Apache-2.0
"""ZeRO-2's bucket reductions, started without waiting for them.

Eager ZeRO-2 (``stage_1_and_2.py``) reduces a full gradient bucket inside the gradient hook that found it full: its
``reduce_ipg_grads`` divides the bucket by the world size, all-reduces a flat copy of it, copies this rank's slices
of the result back into the bucket, and then copies each gradient of this rank's partition out of the bucket into
the partition's gradient buffer (and drops the other gradients). With gloo, and on any device with ``overlap_comm``
off, the all-reduce blocks: backward stops at every full bucket until every rank has reached it.

:class:`BucketFlush` takes ZeRO's place as ``reduce_ipg_grads`` and does the same steps in another order. At a flush
in backward the bucket is divided and its all-reduce is started on the bucket's buffer itself, in place; the bucket
takes a new buffer and the next gradients straight away (the old one is freed when the collective is done). When the
collective is done (at the next flush, or at the end of backward, where ZeRO asks for every bucket) each gradient of
this rank's partition is copied out of the reduced buffer into the partition, as ZeRO copies it. Where the bucket's
communication dtype is not its buffer's (torch autocast), the collective runs on a cast copy instead: the gradients
go to the partition at once (divided, not yet reduced) and this rank's slices of the result are written over them
when it is done. Every value the optimizer reads is eager ZeRO-2's, bit for bit: the same division, the same
collective on the same elements, the same casts. (The other ranks' parts of a gradient that straddles two
partitions, which nothing reads, hold the reduced values here and the divided ones in eager ZeRO-2.) Eager ZeRO-2
copies the bucket flat for its collective and copies its slices back; this order copies neither.

ZeRO allocates its bucket buffers at every backward's first gradient, ``reduce_bucket_size`` elements each (2 GB of
fp32 at DeepSpeed's default); :meth:`BucketFlush.setup_buckets` sizes them to the most a bucket can hold instead.

ZeRO's other reduction paths run as ZeRO runs them (the counters still count them): gradients bucketed by reference
(``contiguous_gradients`` off), a gradient larger than the bucket, MoE and Muon parameters, CPU offload, sequence
parallelism, ZeRO-1, a separate gradient accumulation dtype, and ``reduce_scatter`` or
``use_multi_rank_bucket_allreduce`` off (per-rank reduces).
"""
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..adapters import ZeroBucketReduction
from .comm import CommLog
from .host_comm import Channel, start_sum


@dataclass
class _InFlight:
    work: object
    flat: Tensor  # the bucket's divided gradients in its communication dtype: the collective's buffer
    slices: List[Tuple[Tensor, int, int]]  # (this rank's part of a gradient in the partition, offset in flat, numel)
    later: List[Tuple[Tensor, int]]  # (parameter, group) whose gradient goes to the partition when reduced in place


class BucketFlush:
    """ZeRO-2's ``reduce_ipg_grads`` with the collective left in flight (see the module docstring). Owns the
    all-reduces in flight and the buckets' size; counts into ``comm`` and waits through it (a collective past
    ``compile.collective_timeout_s`` names itself). ``host``: the shared-memory channel for its collectives, where
    every rank is on this host (``compile.host_comm``), else None."""

    def __init__(self, optimizer, comm: CommLog, host: Optional[Channel]):
        self.optimizer = optimizer
        # ZeRO's own, for its other paths (reduce) and to make its buckets (setup)
        self._zero_reduce, self._zero_setup = ZeroBucketReduction.zero_own(optimizer)
        self.comm = comm
        self.in_flight: List[_InFlight] = []  # started all-reduces, oldest first
        self.host = host
        self.overlapped = self.can_overlap(optimizer)
        # (group, ZeRO param id) -> (start, numel) of the part of its gradient in this rank's partition: fixed when
        # ZeRO partitioned its groups, worked out at the first bucket reduced through a cast copy (torch autocast's
        # buckets; the others are reduced in place and need none)
        self._own_parts: Optional[Dict[Tuple[int, int], Tuple[int, int]]] = None
        # the most elements a bucket ever holds: ZeRO reduces it before a gradient would take it past
        # reduce_bucket_size, and it holds the gradient of each parameter of its groups at most once
        held = sum(p.numel() for group in optimizer.bit16_groups for p in group)
        self.bucket_capacity = int(min(optimizer.reduce_bucket_size, held))

    def setup_buckets(self) -> None:
        """ZeRO's ``setup_buckets`` (at a backward's first gradient) with each bucket buffer sized to what it can hold,
        not to ``reduce_bucket_size``: ZeRO allocates that many elements afresh every backward (it frees them at the
        end of each), and DeepSpeed's default, 5e8 elements (2 GB of fp32), is above what glibc serves from its heap,
        so every backward's gradients land on fresh pages and take a page fault each 4 KiB (6716 a step on the
        benchmark's GPT-2 at DeepSpeed's defaults). A buffer of the optimizer's parameters' size is reused from the
        heap."""
        opt = self.optimizer
        if opt.ready_for_gradients:  # set up at this backward's first gradient: ZeRO's own would do nothing either
            return
        self._zero_setup()
        for bucket in opt.ipg_buckets.values():
            bucket.buffer[:] = [b.new_empty(self.bucket_capacity) if b.numel() > self.bucket_capacity else b
                                for b in bucket.buffer]

    @staticmethod
    def can_overlap(opt) -> bool:
        """Whether ZeRO's reduction in optimizer ``opt`` is the one this class reorders: ZeRO-2 copying gradients
        into its contiguous buckets and all-reducing each bucket once (DeepSpeed's defaults)."""
        if not (opt.partition_gradients and opt.contiguous_gradients and opt.reduce_scatter
                and opt.use_multi_rank_bucket_allreduce):
            return False
        if opt.cpu_offload or opt.zenflow or opt.use_grad_accum_attribute or opt.sequence_parallel_size != 1:
            return False
        if any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups))):
            return False
        return not any(getattr(p, "use_muon", False) for group in opt.bit16_groups for p in group)

    # ----- ZeRO's entry point ----------------------------------------------------------------------------------
    def reduce_ipg_grads(self, comm_dtype: Optional[torch.dtype] = None) -> None:
        """ZeRO calls this with the dtype of a bucket that is full (in a gradient hook: start it, finish what was
        in flight before), or with none at the end of backward (reduce every bucket and finish all of them)."""
        opt = self.optimizer
        buckets = opt.ipg_buckets
        start = time.perf_counter()
        sizes = [(buckets[d].elements, d) for d in ([comm_dtype] if comm_dtype is not None else list(buckets))
                 if d in buckets and buckets[d].elements]
        try:
            if not self.overlapped or any(self._zero_path(d) for _, d in sizes):
                self.finish()  # ZeRO's own path, with nothing of ours still in flight (it would read the partition)
                self._zero_reduce(comm_dtype)
            elif comm_dtype is not None:
                self._start(comm_dtype, refill=True)
                self.finish(keep_latest=True)
                self.comm.counters.reduce.reduces_started_ahead += 1
            else:
                for _, dtype in sizes:  # in the buckets' order, the same on every rank: one collective each
                    self._start(dtype, refill=False)
                self.finish()
        finally:
            c = self.comm.counters.reduce
            c.reduce_wait_seconds += time.perf_counter() - start
            c.reduce_collectives += len(sizes)
            c.reduce_bytes += sum(n * d.itemsize for n, d in sizes)

    def _zero_path(self, dtype: torch.dtype) -> bool:
        """A bucket only ZeRO's own code reduces: a gradient wider than the bucket (ZeRO reduces it in place,
        unbucketed), or MoE parameters (another process group per expert)."""
        opt = self.optimizer
        return dtype in opt.extra_large_param_to_reduce or opt.ipg_buckets[dtype].has_moe_params

    # ----- the reordered flush ---------------------------------------------------------------------------------
    def _start(self, dtype: torch.dtype, refill: bool) -> None:
        """Start the all-reduce of a bucket (``refill``: in backward, where the bucket takes more gradients next)."""
        opt = self.optimizer
        bucket = opt.ipg_buckets[dtype]
        group = opt.dp_process_group
        buffer = bucket.buffer[bucket.index]
        tensor = buffer.narrow(0, 0, bucket.elements)
        if opt.gradient_average:
            tensor.div_(dist.get_world_size(group=group) / float(opt.sequence_parallel_size))
        in_place = dtype == tensor.dtype
        if in_place:
            # the bucket's own buffer is the collective's: in backward the bucket takes a new one for the next
            # gradients, and each gradient of this rank's partition stays where it is, reduced in place, until it is
            # copied to the partition at the finish (one copy, as ZeRO's; no copy of the bucket for the collective)
            flat = tensor
            if refill:
                bucket.buffer[bucket.index] = torch.empty_like(buffer)
        else:
            flat = tensor.to(dtype)  # the collective in the communication dtype: this rank's slices are cast back
        if self.host is not None:  # the ranks' sum added in rank order: with 2 ranks gloo's sum bit for bit
            work = start_sum(self.host, flat.view(1, -1), None)
        else:
            work = dist.all_reduce(flat, group=group, async_op=True)
        slices, later = [], []
        offset = 0  # of the gradient in the bucket
        for group_idx, param_idx, param_id in bucket.params:
            param = opt.bit16_groups[group_idx][param_idx]
            assert not opt.params_already_reduced[param_id], \
                f"deepspeed-compile: a parameter's gradient was reduced twice in one backward (ZeRO id {param_id})"
            opt.params_already_reduced[param_id] = True
            if not opt.is_param_in_current_partition[param_id]:
                opt.clear_grad_attribute(param)
            elif in_place:
                later.append((param, group_idx))  # param.grad is its place in the buffer being reduced
            else:
                opt.copy_grads_in_partition(param, group_idx)  # param.grad is now its place in the partition
                if self._own_parts is None:
                    self._own_parts = self._own_parts_of_gradients()
                ours = self._own_parts.get((group_idx, param_id))
                if ours is not None:
                    start, numel = ours
                    slices.append((param.grad.view(-1).narrow(0, start, numel), offset + start, numel))
            offset += param.numel()
        bucket.clear()
        self.in_flight.append(_InFlight(work, flat, slices, later))

    def _own_parts_of_gradients(self) -> Dict[Tuple[int, int], Tuple[int, int]]:
        """For every gradient with a part in this rank's partition, that part's (start, numel), as ZeRO splits a
        parameter that straddles partitions (``grad_start_offset``: where each partition's part begins)."""
        opt = self.optimizer
        rank = dist.get_rank(group=opt.dp_process_group)
        parts = {}
        for group_idx in range(len(opt.bit16_groups)):
            for param_id, partitions in opt.param_to_partition_ids[group_idx].items():
                starts = sorted((opt.grad_start_offset[group_idx][p][param_id], p) for p in partitions)
                for k, (start, partition) in enumerate(starts):
                    if partition == rank:
                        end = starts[k + 1][0] if k + 1 < len(starts) else opt.param_dict[param_id].numel()
                        parts[(group_idx, param_id)] = (start, end - start)
        return parts

    def finish(self, keep_latest: bool = False) -> None:
        """Wait for the started all-reduces (all, or all but the newest) and write this rank's reduced gradients into
        the partition."""
        keep = self.in_flight[-1:] if keep_latest else []
        done = self.in_flight[:len(self.in_flight) - len(keep)]
        self.in_flight = keep
        opt = self.optimizer
        for flight in done:
            self.comm.wait(flight.work, lambda: f"ZeRO-2's gradient all-reduce of {flight.flat.numel()} elements")
            for param, group_idx in flight.later:  # in start order: ZeRO lays the partition out as they come
                opt.copy_grads_in_partition(param, group_idx)
            for dest, offset, numel in flight.slices:
                dest.copy_(flight.flat.narrow(0, offset, numel))
