# SPDX-License-Identifier: Apache-2.0
"""Data for sequence parallelism: the ranks of a sequence group (``sequence_parallel_size`` consecutive ranks) split
one batch between them, so they must be fed the same batch. A loader that shards by rank (DeepSpeed's, a
``DistributedSampler`` with its defaults, the Hugging Face Trainer's) feeds them different ones, which the engine
refuses at the first call. :class:`SequenceGroupSampler` shards by the data-parallel index ``rank //
sequence_parallel_size`` over ``world_size // sequence_parallel_size`` replicas instead (``docs/config.md``,
"Sequence parallelism", shows it with each loader).
"""
from typing import Optional, Tuple

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler


def sequence_data_parallel(sequence_parallel_size: int, rank: Optional[int] = None,
                           world_size: Optional[int] = None) -> Tuple[int, int]:
    """``(num_replicas, rank)`` to shard data by with sequence parallelism: the number of sequence groups and this
    rank's group. ``rank`` and ``world_size`` default to the process group's."""
    from .runtime.sequence import check_size
    world_size = dist.get_world_size() if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    check_size(sequence_parallel_size, world_size)
    return world_size // sequence_parallel_size, rank // sequence_parallel_size


class SequenceGroupSampler(DistributedSampler):
    """A ``DistributedSampler`` that gives every rank of a sequence group the same indices: the shard of the group's
    data-parallel index. Its other arguments (``shuffle``, ``seed``, ``drop_last``) and ``set_epoch`` are
    ``DistributedSampler``'s."""

    def __init__(self, dataset: Dataset, sequence_parallel_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, rank: Optional[int] = None, world_size: Optional[int] = None):
        num_replicas, index = sequence_data_parallel(sequence_parallel_size, rank, world_size)
        super().__init__(dataset, num_replicas=num_replicas, rank=index, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.sequence_parallel_size = sequence_parallel_size
