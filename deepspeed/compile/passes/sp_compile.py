# SPDX-License-Identifier: Apache-2.0
"""Entry point (the name stock DeepSpeed's AutoSP users import): :func:`prepare_autosp_inputs`.

With ``"passes": ["autosp"]`` the engine needs nothing from it for ``transformers`` models: their ``input_ids`` are
found by name and every input named in ``runtime/sequence.SEQUENCE_INPUTS`` is marked dynamic on the way in. A model
whose token ids arrive under another name, or whose sequence is not dimension 1, tags them here (or sets
``tensor.tag`` to a key of ``deepspeed.compile.constants`` itself, as stock's scripts do).
"""
from typing import Optional, Tuple

import torch

from .. import constants


def prepare_autosp_inputs(input_id: torch.Tensor, label_id: torch.Tensor, position_id: Optional[torch.Tensor] = None,
                          attention_mask: Optional[torch.Tensor] = None, seq_dim: int = 1
                          ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """As stock DeepSpeed's function of this name: mark dimension ``seq_dim`` of each tensor given dynamic (the
    sequence-parallel rewrite finds the sequence by its length's symbol) and tag the token ids, labels and position
    ids ``(constants.AUTOSP_*_KEY, seq_dim)``. Returns the tensors. A ``seq_dim`` that is not a dimension of each
    tensor is a ``ValueError``."""
    if input_id is None:
        raise ValueError("prepare_autosp_inputs: input_id is required")
    if label_id is None:
        raise ValueError("prepare_autosp_inputs: label_id is required")
    named = {"input_id": input_id, "label_id": label_id, "position_id": position_id, "attention_mask": attention_mask}
    for name, tensor in named.items():
        if tensor is not None and not 0 <= seq_dim < tensor.dim():
            raise ValueError(f"prepare_autosp_inputs: seq_dim={seq_dim} is not a dimension of {name} "
                             f"(shape {tuple(tensor.shape)})")
    for tensor in named.values():
        if tensor is not None:
            # maybe_: a length dynamo must specialize (a length of 1) compiles for it instead of failing the trace
            torch._dynamo.maybe_mark_dynamic(tensor, seq_dim)
    # dynamo keeps a tensor's ``tag`` attribute in its graph input's metadata: the dimension travels with the key
    input_id.tag = (constants.AUTOSP_INPUT_ID_KEY, seq_dim)
    label_id.tag = (constants.AUTOSP_LABEL_ID_KEY, seq_dim)
    if position_id is not None:
        position_id.tag = (constants.AUTOSP_POSITION_ID_KEY, seq_dim)
    return input_id, label_id, position_id, attention_mask
