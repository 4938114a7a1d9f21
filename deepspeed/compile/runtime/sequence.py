# SPDX-License-Identifier: Apache-2.0
"""The sequence group: the ranks that split one sequence between them (``"passes": ["autosp"]`` with
``sequence_parallel_size``), and its collectives, which the graph ops ``dsc::seq_*`` call (``runtime/ops.py``).

The world is a grid of ``world_size / sequence_parallel_size`` groups of ``sequence_parallel_size`` consecutive ranks:
the ranks of a group are fed the same batch and each computes its block of every sequence; ZeRO shards and reduces
over the whole world as it does without sequence parallelism ([Note: gradients of a sharded sequence] in
``graph/sequence.py`` says why that is exact). Every collective goes through the process group, waits at most
``compile.collective_timeout_s`` (else the group's own timeout) and names itself when it times out.
"""
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import CommLog


class RankGroup:
    """A process group's collectives as the graph ops run them: each waits at most ``compile.collective_timeout_s``
    (``comm``) and names itself and its group (``label``) when it times out."""

    def __init__(self, group, comm: CommLog, label: str):
        self.group = group
        self.size = dist.get_world_size(group=group)
        self.comm = comm
        self.label = label
        self.in_flight: Dict[int, object] = {}  # started all-reduces by their buffer's address (start_all_reduce)

    def _wait(self, work, what: Callable[[], str]) -> None:
        self.comm.wait(work, lambda: f"{what()} of {self.label}")

    def _agree(self) -> None:
        """Before a collective: where a graph started since the ranks last agreed, they agree first
        (``runtime/agreement.py``), so that a rank that could not run its graph stops its peers here."""
        self.comm.before_start()

    def all_reduce(self, x: Tensor) -> Tensor:
        return self.finish_all_reduce(self.start_all_reduce(x))

    def start_all_reduce(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the group, started: a new buffer that holds the sum once :meth:`finish_all_reduce`
        returned for it. Any number may be in flight; each is finished by its buffer."""
        total = x.detach().clone(memory_format=torch.contiguous_format)
        self._agree()
        work = dist.all_reduce(total, group=self.group, async_op=True)
        if total.numel():
            self.in_flight[total.data_ptr()] = work
        else:  # an empty buffer has no address of its own to be known by: finished here
            self._wait(work, lambda: f"an all-reduce of {tuple(total.shape)}")
        return total

    def finish_all_reduce(self, total: Tensor) -> Tensor:
        """Wait for the all-reduce :meth:`start_all_reduce` started into ``total``; returns ``total``."""
        if not total.numel():
            return total
        work = self.in_flight.pop(total.data_ptr(), None)
        if work is None:
            raise RuntimeError(f"deepspeed-compile: no all-reduce of {self.label} is in flight into this buffer "
                               f"{tuple(total.shape)}: a sum was waited for that was never started, or twice")
        self._wait(work, lambda: f"an all-reduce of {tuple(total.shape)}")
        return total


class SequenceGroup(RankGroup):

    def __init__(self, size: int, comm: CommLog):
        world, rank = dist.get_world_size(), dist.get_rank()
        check_size(size, world)
        self.rank = rank % size  # this rank's block of each sequence
        self.index = rank // size  # which group: the data-parallel index of the batch it is fed
        self.ranks = list(range(self.index * size, (self.index + 1) * size))
        # every rank creates every group, in the same order (torch.distributed's rule for new_group)
        groups = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(world // size)]
        super().__init__(groups[self.index], comm, f"the sequence group (ranks {self.ranks})")

    def all_to_all(self, x: Tensor, scatter_dim: int, gather_dim: int) -> Tensor:
        sent = torch.stack(x.chunk(self.size, dim=scatter_dim)).contiguous()
        received = torch.empty_like(sent)
        self._agree()
        self._wait(dist.all_to_all_single(received, sent, group=self.group, async_op=True),
                   lambda: f"an all-to-all of {tuple(x.shape)}")
        return torch.cat(received.unbind(0), dim=gather_dim)

    def all_gather(self, x: Tensor, dim: int) -> Tensor:
        x = x.contiguous()
        blocks: List[Tensor] = [torch.empty_like(x) for _ in range(self.size)]
        self._agree()
        self._wait(dist.all_gather(blocks, x, group=self.group, async_op=True),
                   lambda: f"an all-gather of {tuple(x.shape)}")
        return torch.cat(blocks, dim=dim)

    def reduce_scatter(self, x: Tensor, dim: int) -> Tensor:
        total = self.all_reduce(x)
        return total.chunk(self.size, dim=dim)[self.rank].contiguous()

    def guard(self, compiled: Callable, cut_inputs: List[Tuple[int, int]]) -> Callable:
        """``compiled`` (a graph :func:`~..graph.sequence.shard_sequence` rewrote), refusing a sequence length the
        group's size does not divide (a ValueError naming ``sequence_parallel_size``, on every rank of the group, which
        are fed the same batch), and checking at its first call that the group's ranks are fed the same batch."""
        checked = []

        def run(*args):
            for index, dim in cut_inputs:
                length = args[index].shape[dim]
                if length % self.size:
                    raise ValueError(
                        f"deepspeed-compile: sequence parallelism splits each sequence into sequence_parallel_size="
                        f"{self.size} equal blocks, and this batch's sequence length {length} does not divide by it. "
                        f"Pad the batch to a multiple of {self.size} (a collator's pad_to_multiple_of={self.size}: "
                        "padding tokens masked out, labels -100)")
            if not checked:
                self.check_same_batch([arg for arg in args if isinstance(arg, Tensor)])
                checked.append(True)
            return compiled(*args)

        return run

    def check_same_batch(self, tensors: List[Tensor]) -> None:
        """Every rank of the group must be fed the same batch: a ValueError on every rank of the group where not
        (compared through a checksum of the integer inputs: token ids, labels, masks)."""
        ints = [t for t in tensors if isinstance(t, Tensor) and not t.is_floating_point() and t.numel()]
        if not ints or self.size == 1:
            return
        mine = torch.stack([torch.tensor([t.numel(), int(t.long().sum()), int((t.long() * 31 + 7).pow(2).sum())])
                            for t in ints]).flatten().double()
        low, high = mine.clone(), mine.clone()
        self._agree()
        self._wait(dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group, async_op=True),
                   lambda: "the check that its ranks are fed the same batch")
        self._wait(dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                   lambda: "the check that its ranks are fed the same batch")
        if not torch.equal(low, high):
            raise ValueError(
                f"deepspeed-compile: sequence parallelism (sequence_parallel_size={self.size}) needs the ranks "
                f"{self.ranks}, which split each sequence between them, to be fed the same batch, and they were not. "
                f"Sample the data by the data-parallel index rank // sequence_parallel_size (here {self.index}), "
                "not by the rank")


# the inputs whose dimension 1 is the sequence, marked dynamic before dynamo first traces them: the rewrite finds the
# sequence by its length's symbol (a length traced as a number could not be told from other sizes)
SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "labels", "position_ids", "attention_mask", "token_type_ids")


def mark_dynamic_lengths(args, kwargs) -> None:
    """Mark the sequence dimension of a model call's inputs dynamic: those named in :data:`SEQUENCE_INPUTS`, and the
    first positional input (a model called as ``model(input_ids, ...)``)."""
    tensors = [kwargs.get(name) for name in SEQUENCE_INPUTS] + list(args[:1])
    for tensor in tensors:
        if isinstance(tensor, Tensor) and tensor.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(tensor, 1)


def requested_size(param_dict) -> int:
    """``sequence_parallel_size`` of a ds_config (a dict), checked against the world size."""
    size = param_dict.get("sequence_parallel_size", 1)
    check_size(size, dist.get_world_size())
    return size


def check_size(size: int, world: int) -> None:
    """``sequence_parallel_size`` must divide the world size: a ValueError naming it where not."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
        raise ValueError(f"deepspeed-compile: sequence_parallel_size={size!r} must be a positive integer that divides "
                         f"the world size ({world})")
