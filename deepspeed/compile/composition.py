# SPDX-License-Identifier: Apache-2.0
"""What sequence parallelism (``"passes": ["autosp"]``) composes with, checked at ``engine.compile()`` before any
state changes: a configuration the sequence rewrite cannot make exact is refused with a ``ValueError`` naming the
setting and what to do instead.

The rewrite's gradients are exact where ZeRO (or, at ZeRO-0, the engine) averages them over every rank of the world
([Note: gradients of a sharded sequence] in ``graph/sequence.py``): each rank's gradient is ``sequence_parallel_size``
times its block's share, and the world's average divides that factor out. So it refuses:

- tensor parallelism in the same engine (``"autotp"`` in ``passes`` or ``tensor_parallel.autotp_size > 1``), as stock
  DeepSpeed does: AutoTP makes ZeRO's group the tensor-parallel group's complement, and the two rewrites are not
  composed;
- DeepSpeed's own sequence parallelism (a data x sequence mesh from ``data_parallel_size`` with
  ``sequence_parallel_size``, a ``mesh_param``, an ``mpu`` with ``get_sequence_parallel_world_size``): an alternative
  to ``"autosp"``, whose groups it sets for Ulysses' attention layers (with a mesh, ZeRO averages over the
  data-parallel dimension only, and the sequence ranks' shares are never summed);
- any other ZeRO group smaller than the world (an ``mpu``'s data-parallel group).

Importing this module is cheap (``import deepspeed`` imports it): the runtime is imported when an engine compiles.
"""
from typing import Optional, Tuple

from .config import CompileConfig


def check_sequence_parallel(engine, compile_config: CompileConfig) -> None:
    """Refuse (``ValueError``) a sequence-parallel engine whose gradients the rewrite cannot make exact; nothing where
    ``"autosp"`` is not listed."""
    if not compile_config.sequence_parallel:
        return
    _refuse_tensor_parallel(engine, compile_config)
    from .runtime.sequence import requested_size
    size = requested_size(engine._config._param_dict)
    if size == 1:  # nothing is split (a warning says so): ZeRO's own averaging stays exact
        return
    own = getattr(engine, "sequence_parallel_size", 1) or 1
    if own != 1:
        source, setting = _own_origin(engine)
        raise ValueError(
            f"deepspeed-compile: compile.passes lists 'autosp' (sequence_parallel_size={size}), and DeepSpeed's own "
            f"sequence parallelism is set up too ({source}: {own} ranks a sequence group). They are "
            "alternatives, not composed: DeepSpeed's sets ZeRO's groups for Ulysses' attention layers, 'autosp' "
            "splits the sequence in the compiled graphs and needs ZeRO over every rank. Remove "
            f"{setting}, keeping sequence_parallel_size (consecutive ranks form each sequence group); or "
            "run DeepSpeed's Ulysses (DistributedAttention) without 'autosp'")
    import torch.distributed as dist
    group = _reduce_group(engine)
    reduced, world = dist.get_world_size(group), dist.get_world_size()
    if reduced != world:
        source, setting = _group_origin(engine)
        raise ValueError(
            f"deepspeed-compile: compile.passes lists 'autosp' (sequence_parallel_size={size}), and ZeRO "
            f"(zero_optimization.stage={engine.zero_optimization_stage()}) averages gradients over {reduced} of the "
            f"{world} ranks ({source}). Sequence parallelism is exact where they are averaged over "
            f"every rank: remove {setting}, and feed the ranks of each sequence group the same batch "
            "(deepspeed.compile.data.SequenceGroupSampler)")


def _refuse_tensor_parallel(engine, compile_config: CompileConfig) -> None:
    autotp_size = engine.autotp_size() or 1
    if not compile_config.tensor_parallel and autotp_size <= 1:
        return
    asked = "compile.passes lists 'autosp' and 'autotp'" if compile_config.tensor_parallel else \
        f"compile.passes lists 'autosp' with tensor_parallel.autotp_size={autotp_size}"
    raise ValueError(f"deepspeed-compile: {asked}: sequence and tensor parallelism are not combined in one engine "
                     "(nor are they in stock DeepSpeed). Use one: 'autosp' with sequence_parallel_size, and no "
                     "'autotp' nor tensor_parallel.autotp_size; or 'autotp' with tensor_parallel.autotp_size, and no "
                     "'autosp'")


def _reduce_group(engine):
    """The group ZeRO averages gradients over: its optimizer's (ZeRO-1/2/3), else the engine's (ZeRO-0)."""
    group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None)
    return group if group is not None else engine.seq_data_parallel_group


def _mesh(engine) -> Optional[object]:
    from deepspeed.utils import groups
    return getattr(engine, "mesh_device", None) or groups.mesh_device


def _own_origin(engine) -> Tuple[str, str]:
    """Where DeepSpeed's own sequence parallelism comes from: (what sets it up, the setting to remove)."""
    if engine.mpu is not None and hasattr(engine.mpu, "get_sequence_parallel_world_size"):
        return ("the mpu passed to deepspeed.initialize has get_sequence_parallel_world_size",
                "the mpu from deepspeed.initialize")
    if "data_parallel_size" in engine._config._param_dict:
        return ("data_parallel_size with sequence_parallel_size in the ds_config makes a data x sequence mesh",
                "data_parallel_size from the ds_config")
    return "a data x sequence mesh (deepspeed.initialize's mesh_param)", "mesh_param from deepspeed.initialize"


def _group_origin(engine) -> Tuple[str, str]:
    """Where ZeRO's smaller data-parallel group comes from: (what makes it, the setting to remove)."""
    if engine.mpu is not None:
        return ("the data-parallel group of the mpu passed to deepspeed.initialize",
                "the mpu from deepspeed.initialize")
    if _mesh(engine) is not None:
        return ("the data-parallel dimension of a device mesh",
                "the device mesh (mesh_param, or data_parallel_size in the ds_config)")
    return "its data-parallel group", "what makes ZeRO's data-parallel group smaller than the world"
