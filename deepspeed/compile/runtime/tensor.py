# SPDX-License-Identifier: Apache-2.0
"""AutoTP's tensor-parallel group as the graph ops ``dsc::tp_*`` use it (``"passes": ["autotp"]`` with
``tensor_parallel.autotp_size``): DeepSpeed's engine shards the linear layers at ``deepspeed.initialize`` (AutoTP's
``LinearLayer``, column-parallel, and ``LinearAllreduce``, row-parallel) and builds the group; the layers' own
collectives are switched off (``adapters.TensorParallelDeferral``) and ``graph/tensor.py`` places them in the graphs.
"""
from .comm import CommLog
from .sequence import RankGroup


def tensor_group(group, comm: CommLog) -> RankGroup:
    """AutoTP's group (DeepSpeed's ``groups.get_tensor_model_parallel_group()``) for the ``dsc::tp_*`` ops."""
    return RankGroup(group, comm, "AutoTP's tensor-parallel group")
