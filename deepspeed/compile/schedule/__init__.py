# SPDX-License-Identifier: Apache-2.0
"""Scheduling of the rewritten ZeRO-3 graphs: the fast-free order and the static memory plan it optimizes."""
from .fast_free import COLLECTIVE_ORDERS, apply_order, compute_fast_free_order, fast_free_schedule
from .memory_plan import (LowerBound, NodeMemory, gathered_lower_bound, largest_gathered_bytes, memory_plan,
                          peak_gathered_bytes)

__all__ = [
    "COLLECTIVE_ORDERS", "LowerBound", "NodeMemory", "apply_order", "compute_fast_free_order", "fast_free_schedule",
    "gathered_lower_bound", "largest_gathered_bytes", "memory_plan", "peak_gathered_bytes"
]
