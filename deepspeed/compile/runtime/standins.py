# SPDX-License-Identifier: Apache-2.0
"""Full-shape stand-ins for partitioned ZeRO-3 parameters, so that tracing sees the right shapes.

A partitioned parameter's ``.data`` is an empty tensor. Right before a compiled forward each one gets a
stride-0 view of a one-element tensor, expanded to ``ds_shape``: the right shape and dtype, 4 bytes of
storage, no full-size memory. dynamo guards on size/stride/dtype, not identity, so the cached stand-ins never
cause a recompile. They stay in place until backward is over (AOTAutograd's backward checks the saved
parameter inputs' metadata) and are then swapped back for ZeRO's own empty ``.data``, so checkpointing and
eager ZeRO-3 code never see them. See docs/capture.md.
"""
from typing import Iterable

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import Tensor
from torch.nn import Parameter

from ..adapters import ParameterData

_STANDIN = "_dsc_standin"  # the cached stand-in on the parameter


def _needs_standin(param: Parameter) -> bool:
    # Every sharded ZeRO-3 parameter the runtime passes in (persistent ones are not passed: they stay gathered
    # across steps, see runtime/z3.py). One kind of input (stride 0, full shape) keeps dynamo's guards stable
    # whatever ZeRO did to .data between steps.
    return hasattr(param, "ds_shape") and hasattr(param, "ds_tensor")


def _is_standin(param: Parameter) -> bool:
    data = param.data
    return data.shape == param.ds_shape and data.numel() > 0 and all(s == 0 for s in data.stride())


def _make_standin(param: Parameter, device: torch.device) -> Tensor:
    # NaN, not uninitialised memory: eager code that wrongly computes with a stand-in gets NaNs, never
    # plausible numbers (and a gradient for it raises, see runtime/eager_access.py)
    fill = float("nan") if param.dtype.is_floating_point else 0
    return torch.full((1, ), fill, dtype=param.dtype, device=device).expand(param.ds_shape)


def install(params: Iterable[Parameter], device: torch.device) -> None:
    """Stand-ins on the device the graphs compute on (``device``), where the gathered parameters will be; with
    ZeRO-3's ``offload_param`` the shards themselves stay on the CPU."""
    for param in params:
        if not _needs_standin(param) or _is_standin(param):
            continue
        if param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_active_sub_modules:
            # gathered by eager ZeRO-3 (a persistent parameter, an eager step before compile): the graphs gather
            # from the shard, so hold no full copy, and keep one kind of input for dynamo's guards
            param.partition()
        standin = getattr(param, _STANDIN, None)
        if standin is None or standin.dtype != param.dtype or standin.device != device:
            standin = _make_standin(param, device)
            setattr(param, _STANDIN, standin)
        ParameterData.swap_in(param, standin)  # ZeRO's own .data kept, put back by uninstall


def uninstall(params: Iterable[Parameter]) -> None:
    for param in params:
        ParameterData.swap_back(param)
