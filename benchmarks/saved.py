# SPDX-License-Identifier: Apache-2.0
"""Saved-for-backward bytes of a finished forward, read off the autograd graph (no hooks, no recompiles).

Walks ``loss.grad_fn`` and collects every saved tensor (``_saved_*`` of built-in nodes, ``saved_tensors`` of
custom Functions such as AOTAutograd's ``CompiledFunctionBackward``), counting each storage once by its
current size: a parameter that ZeRO-3 or FSDP2 has already released counts 0, a view that keeps a gathered
buffer alive counts in full.

A saved tensor is *parameter-derived* when it is a parameter (a leaf that requires grad) or reaches one through
views and dtype casts only. This lineage exists in eager autograd graphs; tensors saved by a compiled graph
carry none, so for compiled rows the parameter-derived figure is a lower bound (the DeepCompile rows use the
engine's own report instead).
"""
from typing import Dict, Iterable, Tuple

import torch

_ALIAS_OR_CAST = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                  "ExpandBackward0", "SplitBackward0", "SplitWithSizesBackward0", "UnbindBackward0",
                  "SliceBackward0", "SelectBackward0", "AliasBackward0", "UnsqueezeBackward0",
                  "SqueezeBackward0", "SqueezeBackward1", "AsStridedBackward0", "UnsafeViewBackward0",
                  "ReshapeAliasBackward0", "DetachBackward0"}


def _saved_of(node) -> Iterable[torch.Tensor]:
    if hasattr(node, "saved_tensors"):  # custom autograd.Function
        try:
            yield from (t for t in node.saved_tensors if isinstance(t, torch.Tensor))
        except RuntimeError:
            pass
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed or not a tensor
            continue
        values = value if isinstance(value, (list, tuple)) else (value,)
        yield from (v for v in values if isinstance(v, torch.Tensor))


def _is_param_derived(t: torch.Tensor) -> bool:
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _ALIAS_OR_CAST:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return fn is not None and type(fn).__name__ == "AccumulateGrad"


def saved_bytes(loss: torch.Tensor) -> Tuple[int, int]:
    """(parameter-derived bytes, other bytes) saved for the backward of ``loss``."""
    seen, stack = set(), [loss.grad_fn]
    storages: Dict[int, Tuple[int, bool]] = {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(f for f, _ in node.next_functions)
        for t in _saved_of(node):
            if t.device.type == "meta":
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.data_ptr() == 0 or storage.nbytes() == 0:
                continue
            key = storage.data_ptr()
            nbytes, derived = storages.get(key, (0, False))
            storages[key] = (max(nbytes, storage.nbytes()), derived or _is_param_derived(t))
    param = sum(n for n, d in storages.values() if d)
    other = sum(n for n, d in storages.values() if not d)
    return param, other
