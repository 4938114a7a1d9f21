# SPDX-License-Identifier: Apache-2.0
"""Native (C++/CUDA) implementations of the runtime's hot ops, with pure-Python twins of the same contract.

``load_native(mode)`` returns the native ``cast_all_gather`` (its start form is ``cast_all_gather_start``) or None (use ``cast_all_gather_python``); the
``compile.native_op`` option ("auto" | "native" | "python") is its ``mode``. See ``docs/native_op.md``.
"""
from .gather import (NATIVE_MODES, InFlight, cast_all_gather, cast_all_gather_python, cast_all_gather_start, load_native,
                     native_op_error)

__all__ = [
    "NATIVE_MODES", "InFlight", "cast_all_gather", "cast_all_gather_python", "cast_all_gather_start", "load_native",
    "native_op_error"
]
