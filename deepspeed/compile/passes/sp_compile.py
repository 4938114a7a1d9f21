# SPDX-License-Identifier: Apache-2.0
"""Entry point (the name stock DeepSpeed's AutoSP users import): :func:`prepare_autosp_inputs`.

With ``"passes": ["autosp"]`` the engine needs nothing from it for ``transformers`` models: their ``input_ids`` are
found by name and every input named in ``runtime/sequence.SEQUENCE_INPUTS`` is marked dynamic on the way in. A model
whose token ids arrive under another name, or whose sequence is not dimension 1, tags them here.
"""
from typing import Optional, Tuple

import torch

from ..graph.sequence import INPUT_IDS_TAG


def prepare_autosp_inputs(input_id: torch.Tensor, label_id: torch.Tensor, position_id: Optional[torch.Tensor] = None,
                          attention_mask: Optional[torch.Tensor] = None, seq_dim: int = 1
                          ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Tag ``input_id`` as the token ids whose dimension ``seq_dim`` is the sequence, and mark that dimension
    dynamic in each tensor given (the sequence-parallel rewrite finds the sequence by its length's symbol). Returns
    the tensors, as stock DeepSpeed's function of this name does."""
    if input_id is None or label_id is None:
        raise ValueError("prepare_autosp_inputs: input_id and label_id are required")
    named = {"input_id": input_id, "label_id": label_id, "position_id": position_id, "attention_mask": attention_mask}
    for name, tensor in named.items():
        if tensor is not None and not -tensor.dim() <= seq_dim < tensor.dim():
            raise ValueError(f"prepare_autosp_inputs: seq_dim={seq_dim} is not a dimension of {name} "
                             f"(shape {tuple(tensor.shape)})")
    for tensor in named.values():
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, seq_dim % tensor.dim())
    input_id.tag = (INPUT_IDS_TAG, seq_dim % input_id.dim())
    return input_id, label_id, position_id, attention_mask
