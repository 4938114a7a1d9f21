# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 runtime's gradient reduction: gradients from the compiled backward (``reduce_grad``) and from eager
code, bucketed and reduce-scattered into the ZeRO-3 optimizer's gradient partitions.

Each gradient is copied into a bucket in its parameter's communication dtype (eager ZeRO-3's choice, by
``torch_autocast`` and ``communication_data_type``); a full bucket's reduce-scatter starts without waiting and is
finished, its partitions handed to the optimizer, at the next flush or at the end of backward. gloo has no AVG, so
buckets are pre-divided by the world size and summed, as eager ZeRO-3 does.

On gloo the reduce-scatter is an all-reduce of the bucket in place, of which this rank keeps its row. That is what
torch's gloo backend runs for ``reduce_scatter_tensor`` itself (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``:
a clone of the input, an all-reduce of the clone, a copy of this rank's chunk out), without the clone and the copy:
the same collective on the same values, so the same sums for any number of ranks, in less time
(``benchmarks/gloo_collectives.py`` times both; ``docs/benchmarks.md``) and with no receive buffer.

Where every rank is on this host (``compile.host_comm``), a bucket goes through shared memory instead, in chunks of
columns, read where they lie in the bucket (no compaction): each rank writes its bucket's chunk into its slot,
divided by the world size on the way, and each sums its own row of every rank's slot into its bucket, in rank
order. With two ranks that is gloo's sum bit for bit (a + b is b + a); with more, the order of the additions may
differ from gloo's ring.
"""
import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter

from .comm import CommLog
from .host_comm import start_sum
from .transport import Transport


BUCKET_SHARE = 4  # no bucket is wider than 1/4 of all trained parameters' partitions (_bucket_buffer)


@dataclass
class _Bucket:
    buffer: Tensor  # (world_size, columns)
    items: List[Tuple[Parameter, int]] = field(default_factory=list)
    used: int = 0


@dataclass
class _PendingReduce:
    work: object
    buffer: Tensor  # the bucket buffer it sends from: not reused until the collective is done
    recv: Tensor
    items: List[Tuple[Parameter, int]]
    issued: float


class GradientReducer:
    """Owns the gradient buckets, the reduce-scatters in flight, and which parameters owe or hold a gradient in this
    backward. The reducer protocol every stage keeps (``z12_reduce.GradientHandOff`` is ZeRO-1/2's): ``note_source``,
    ``forget_sources``, ``reduce(ds_id, grad)``, ``end_of_backward``."""

    def __init__(self, optimizer, params: Dict[int, Parameter], transport: Transport, bucket_numel: int,
                 comm: CommLog):
        self.optimizer = optimizer
        self.params = params
        self.transport = transport
        self.bucket_numel = bucket_numel  # DeepSpeed's reduce_bucket_size
        self.comm = comm
        # the columns one reduce of every trained parameter needs: no bucket is ever wider
        self._grad_columns = sum(p.partition_numel() for p in params.values() if p.requires_grad)
        self.buffers: Dict[torch.dtype, List[Tensor]] = {}  # the bucket buffers, reused from step to step
        self._buckets: Dict[torch.dtype, _Bucket] = {}
        self._pending: List[_PendingReduce] = []  # started reduce-scatters, oldest first
        self._reduced: set = set()  # ds_ids whose gradient reached the optimizer in this backward
        self._grad_sources: Dict[int, int] = {}  # ds_id -> uses in this step's forward still owing a gradient
        self._held_grads: Dict[int, Tensor] = {}  # summed gradients of parameters with more uses to come

    def note_source(self, param: Parameter) -> None:
        """A forward graph (or eager code) used ``param``: one more gradient for it may come in backward."""
        if param.requires_grad:
            self._grad_sources[param.ds_id] = self._grad_sources.get(param.ds_id, 0) + 1

    def forget_sources(self) -> None:
        """A forward whose backward will not run: the gradients it announced will not come."""
        self._grad_sources.clear()

    def reduce(self, ds_id: int, grad: Tensor, owned: bool = False) -> None:
        """Queue parameter ``ds_id``'s gradient for the reduce-scatter. A parameter used by several graphs, or by
        a graph and eager code (a tied weight across a graph break), gets one gradient from each: they are summed
        first and reduced once, as autograd's accumulation does for eager ZeRO-3 (same sum, same rounding).
        ``owned``: nothing else reads ``grad``'s storage, so it may be reduced where it lies (:meth:`bucket_grad`)."""
        remaining = self._grad_sources.get(ds_id, 0)
        held = self._held_grads.get(ds_id)
        if held is not None:
            held.add_(grad)
        elif remaining > 1:
            held = self._held_grads[ds_id] = grad.detach().clone(memory_format=torch.contiguous_format)
        if remaining > 0:
            self._grad_sources[ds_id] = remaining - 1
        if held is not None:
            if remaining > 1:
                return  # more gradients of this parameter are coming in this backward
            grad, owned = self._held_grads.pop(ds_id), True  # the sum is ours
        self.bucket_grad(ds_id, grad, owned)

    def end_of_backward(self) -> None:
        """Everything this backward reduced, in the optimizer's partitions: held gradients whose other uses gave
        none (no gradient flowed there) reduced as they are, every bucket flushed and every reduce-scatter done."""
        for ds_id in sorted(self._held_grads):
            self.bucket_grad(ds_id, self._held_grads.pop(ds_id), owned=True)
        self._grad_sources.clear()
        for dtype in sorted(self._buckets, key=str):
            self._flush(dtype)
        self._finish_reduces()
        self._reduced.clear()

    def bucket_grad(self, ds_id: int, grad: Tensor, owned: bool = False) -> None:
        """Copy the gradient into the bucket now, whatever other uses of the parameter are still to come (a compiled
        graph may reuse its buffer right after this op); reduce-scatter the bucket when the next gradient would not
        fit. A gradient wider than a bucket gets a bucket of its own: where nothing else reads it (``owned``) and its
        elements are the bucket's rows as they lie (contiguous, in the communication dtype, no shard padding), that
        bucket is the gradient itself, not a new buffer it is copied into (a tied embedding's: 154 MB at GPT-2 124M)."""
        param = self.params[ds_id]
        # the parameter's communication dtype, as eager ZeRO-3 chooses it: under torch_autocast the gradients of
        # lower-precision-safe modules travel in the autocast dtype (half the bytes), the others in their own
        dtype = self.optimizer.get_param_comm_dtype(param)
        width = param.partition_numel()
        bucket = self._buckets.get(dtype)
        if bucket is not None and bucket.used + width > bucket.buffer.shape[1]:
            self._flush(dtype)
            bucket = None
        world_size = self.transport.world_size
        if bucket is None and owned and width > self._columns and grad.dtype == dtype and grad.is_contiguous() \
                and grad.numel() == world_size * width:
            bucket = self._buckets[dtype] = _Bucket(grad.view(world_size, width))
            self.comm.counters.reduce.grads_reduced_in_place += 1
        else:
            if bucket is None:
                bucket = self._buckets[dtype] = _Bucket(self._bucket_buffer(dtype, width, grad.device))
            # row r of the bucket holds rank r's slice of every gradient (padding stays zero)
            flat = grad.reshape(-1)
            rows = bucket.buffer[:, bucket.used:bucket.used + width]
            full = flat.numel() // width
            rows[:full].copy_(flat[:full * width].view(full, width))
            if full < world_size:  # the padded tail of the last shards: the rest of its row, and later rows, are 0
                rest = flat.numel() - full * width
                rows[full, :rest].copy_(flat[full * width:])
                rows[full, rest:].zero_()
                rows[full + 1:].zero_()
        bucket.items.append((param, width))
        bucket.used += width
        self.comm.counters.reduce.reduces += 1

    def _bucket_buffer(self, dtype: torch.dtype, width: int, device: torch.device) -> Tensor:
        """A (world_size, columns) buffer, allocated once per dtype and reused (as eager ZeRO-3 keeps its gradient
        bucket), and never zeroed: every gradient writes its columns whole, padding included. A gradient wider than
        the bucket gets a buffer of its own. ``reduce_bucket_size`` bounds it, and so does a quarter of all trained
        parameters' partitions together (``BUCKET_SHARE``): at DeepSpeed's default, 5e8 elements, one bucket would
        otherwise hold the whole model's gradient (2 GB of fp32 on GPT-2 355M with 2 ranks), whose reduce could
        only start when backward ends. With the share, the first reduce starts a quarter of the way through
        backward's gradients, and at most half of them are held in buckets (one reducing, one filling)."""
        world_size = self.transport.world_size
        if width > self._columns:
            return torch.empty(world_size, width, dtype=dtype, device=device)
        busy = {id(pending.buffer) for pending in self._pending}
        buffers = self.buffers.setdefault(dtype, [])
        for buffer in buffers:
            if id(buffer) not in busy and buffer.device == device:
                return buffer
        # the other one is still being reduce-scattered: a second buffer (never more: one flush is in flight)
        buffer = torch.empty(world_size, self._columns, dtype=dtype, device=device)
        buffers.append(buffer)
        return buffer

    @property
    def _columns(self) -> int:
        """A bucket's width (:meth:`_bucket_buffer`)."""
        return min(self.bucket_numel // self.transport.world_size, max(1, self._grad_columns // BUCKET_SHARE))

    def _compact(self, bucket: _Bucket) -> Tensor:
        """The used columns of the bucket as one contiguous (world_size * used) buffer, moved to the front of the
        bucket's own storage row by row (a row-sized temporary, not a bucket-sized copy)."""
        buffer, used = bucket.buffer, bucket.used
        flat = buffer.view(-1)
        if used < buffer.shape[1]:
            for r in range(1, self.transport.world_size):
                flat[r * used:(r + 1) * used].copy_(buffer[r, :used].clone())  # clone: the ranges may overlap
        return flat[:self.transport.world_size * used]

    def _flush(self, dtype: torch.dtype) -> None:
        """Start the bucket's reduce-scatter without waiting: it runs while backward goes on, and is finished
        (its partitions handed to the optimizer) at the next flush or at the end of backward."""
        bucket = self._buckets.pop(dtype, None)
        if bucket is None or not bucket.items:
            return
        self._finish_reduces()
        self.comm.before_start()
        transport = self.transport
        world_size, rank = transport.world_size, transport.rank
        # gloo has no AVG: pre-divide, then SUM (as eager ZeRO-3 does)
        if transport.host is not None:  # the used columns where they lie, divided on their way to the slots
            send = bucket.buffer[:, :bucket.used]
            recv = send[rank]
            work = start_sum(transport.host.reduce, send, rank, divisor=world_size)
        else:
            send = self._compact(bucket)
            send.div_(world_size)
            if transport.reduce_scatter_by_all_reduce:  # this rank's row of the summed bucket is its partition
                work = dist.all_reduce(send, group=transport.group, async_op=True)
                recv = send.view(world_size, bucket.used)[rank]
            else:
                recv = torch.empty(bucket.used, dtype=dtype, device=send.device)
                work = dist.reduce_scatter_single(recv, send, group=transport.group, async_op=True)
        c = self.comm.counters.reduce
        c.reduce_scatter_bytes += send.numel() * send.element_size()
        c.reduce_bytes += send.numel() * send.element_size()
        c.reduce_collectives += 1
        self.comm.issued("reduce-scatter", [param for param, _ in bucket.items], send.numel())
        self._pending.append(_PendingReduce(work, bucket.buffer, recv, bucket.items, time.perf_counter()))

    def _finish_reduces(self) -> None:
        while self._pending:
            pending = self._pending.pop(0)
            start = time.perf_counter()
            self.comm.wait(pending.work, lambda: f"a gradient reduce-scatter ({len(pending.items)} parameters)")
            self.comm.done("reduce-scatter", start, pending.issued)
            self._hand_to_optimizer(pending.items, pending.recv)

    def _hand_to_optimizer(self, items: List[Tuple[Parameter, int]], recv: Tensor) -> None:
        partitions = recv.split([w for _, w in items])
        first, again = [], []
        for (param, _), part in zip(items, partitions):
            (again if param.ds_id in self._reduced else first).append((param, part))
            self._reduced.add(param.ds_id)
        # DeepSpeed's own bookkeeping: copies (first micro-step) or accumulates into the optimizer's partitions
        if first:
            self.optimizer.partition_grads([p for p, _ in first], [g for _, g in first])
        if again:
            # a second gradient for a parameter in this backward (used by a compiled graph and by eager code, e.g.
            # a tied weight): it must add to the first, which DeepSpeed does from its second micro-step on
            micro_step = self.optimizer.micro_step_id
            self.optimizer.micro_step_id = max(micro_step, 1)
            try:
                self.optimizer.partition_grads([p for p, _ in again], [g for _, g in again])
            finally:
                self.optimizer.micro_step_id = micro_step
