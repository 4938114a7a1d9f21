# SPDX-License-Identifier: Apache-2.0
"""Stock DeepSpeed's AutoSP tag keys, with stock's names and values: a script sets ``tensor.tag`` to one of them (or
to ``(key, seq_dim)``, as ``passes.sp_compile.prepare_autosp_inputs`` does) to name its token ids, labels and
position ids to the sequence-parallel rewrite (``graph/sequence.py``)."""

AUTOSP_INPUT_ID_KEY = "input_id"
AUTOSP_LABEL_ID_KEY = "label_id"
AUTOSP_POSITION_ID_KEY = "position_id"
