# SPDX-License-Identifier: Apache-2.0
"""AutoTP's tensor-parallel group as the graph ops ``dsc::tp_*`` use it (``"passes": ["autotp"]`` with
``tensor_parallel.autotp_size``): DeepSpeed's engine shards the linear layers at ``deepspeed.initialize`` (AutoTP's
``LinearLayer``, column-parallel, and ``LinearAllreduce``, row-parallel) and builds the group; the layers' own
collectives are switched off (``adapters.TensorParallelDeferral``) and ``graph/tensor.py`` places them in the graphs.
"""
import torch
import torch.distributed as dist
from torch import Tensor

from .comm import CommLog


class TensorGroup:
    """AutoTP's group (DeepSpeed's ``groups.get_tensor_model_parallel_group()``), its all-reduce timed out and named
    as every collective of the runtime."""

    def __init__(self, group, comm: CommLog):
        self.group = group
        self.size = dist.get_world_size(group=group)
        self.comm = comm

    def all_reduce(self, x: Tensor) -> Tensor:
        total = x.detach().clone(memory_format=torch.contiguous_format)
        self.comm.wait(dist.all_reduce(total, group=self.group, async_op=True),
                       lambda: f"a tensor-parallel all-reduce of {tuple(x.shape)}")
        return total
