# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 runtime's parameters: who they are, by ``ds_id`` and by name, and which one a graph input stands in
for."""
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.nn import Parameter

from . import registry


class ShardedParams:
    """One engine's ZeRO-3 parameters. Owns: ``params`` (``ds_id`` -> parameter), the ``sharded`` ones the graphs
    gather and the ``persistent`` ones they read as they are, their ``names``, whether the shards are ``offloaded``,
    and the index from a stand-in's addresses to its parameter (:meth:`param_of`)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.params: Dict[int, Parameter] = {p.ds_id: p for p in module.parameters() if hasattr(p, "ds_id")}
        # Persistent parameters (DeepSpeed's stage3_param_persistence_threshold) stay gathered across steps, as in
        # eager ZeRO-3: the graphs read them as they are, with no gather or release op, and ZeRO-3's optimizer
        # gathers them again after each step. Only the others are sharded, stood in for and gathered in the graphs.
        self.persistent: List[Parameter] = [p for p in self.params.values() if getattr(p, "ds_persist", False)]
        self.sharded: Dict[int, Parameter] = {i: p for i, p in self.params.items()
                                              if not getattr(p, "ds_persist", False)}
        self.names: Dict[int, str] = {p.ds_id: name for name, p in module.named_parameters() if hasattr(p, "ds_id")}
        self.by_name: Dict[str, Parameter] = {name: self.params[ds_id] for ds_id, name in self.names.items()}
        # ZeRO-3's offload_param keeps the shards elsewhere (the CPU): a gather copies them to the device first, as
        # eager ZeRO-3 does, and the cast and collective run there
        self.offloaded = any(p.ds_tensor.device != device for p in self.sharded.values())
        self._by_standin: Dict[Tuple[int, int], Parameter] = {}  # a stand-in's addresses -> its parameter

    def name(self, param: Parameter) -> str:
        """A parameter as errors name it."""
        return f"'{self.names.get(param.ds_id, '?')}' (ds_id {param.ds_id}, shape {tuple(param.ds_shape)})"

    def shard_numel(self) -> int:
        return sum(p.ds_tensor.numel() for p in self.sharded.values())

    def trained_partition_bytes(self) -> int:
        """Bytes of this rank's partitions of every trained parameter, sharded or persistent (the gradients the
        runtime reduces), counting each element as at least fp32 (a gradient may be reduced in fp32)."""
        return sum(p.ds_tensor.numel() * max(4, p.ds_tensor.element_size()) for p in self.params.values()
                   if p.requires_grad)

    def shard_itemsize(self, default: int = 0) -> int:
        """The widest sharded parameter dtype's size (``default`` without sharded parameters)."""
        return max((p.ds_tensor.element_size() for p in self.sharded.values()), default=default)

    def ds_ids(self, inputs) -> List[Optional[int]]:
        """ds_id of every graph input that is one of these sharded parameters (None elsewhere)."""
        return [t.ds_id if isinstance(t, Parameter) and self.sharded.get(getattr(t, "ds_id", None)) is t else None
                for t in inputs]

    def param_of(self, standin: Tensor) -> Parameter:
        """The sharded parameter a graph input stands in for (the ops find their parameter this way, so a graph
        serves any module of the same code): its stand-in's storage, which the parameter's ``.data`` views while
        the graphs run (``standins.install``), whatever wrapper of it the graph was handed."""
        # the storage and the data pointer: a parameter gathered for eager code may share one storage with others
        # (ZeRO-3 gathers a leaf module's parameters into one buffer), a stand-in never does
        address = (standin.untyped_storage().data_ptr(), standin.data_ptr())
        param = self._by_standin.get(address)
        if param is None or (param.data.untyped_storage().data_ptr(), param.data.data_ptr()) != address:
            # not from an empty .data: ZeRO's own partitioned ones all share one address, which names no parameter
            self._by_standin = {(p.data.untyped_storage().data_ptr(), p.data.data_ptr()): p
                                for p in self.sharded.values() if p.data.numel()}
            param = self._by_standin.get(address)
            if param is None and standin.numel() == 0:
                # a graph saved the parameter itself for its backward, and the step's backward has put ZeRO's empty
                # .data back since: this backward runs after the one that ended its step
                raise registry.backward_after_its_step()
            if param is None:
                raise AssertionError("deepspeed-compile: a graph op was given a tensor that is not the stand-in of "
                                     "a sharded ZeRO-3 parameter of this engine")
        return param
