"""Engine-facing pass registry: the names DeepSpeed's engine imports from ``deepspeed.compile.backend``.

The engine registers its stock pass names here at start-up and reads ``opt_passes`` to resolve a schedule.
The dynamo backend itself is built per engine by :func:`deepspeed.compile.init_z3.init_z3`.
"""
from typing import Callable, Dict, Optional

from .passes.contract import CONTRACTS, PassContract

opt_passes: Dict[str, Callable] = {}
# Seconds spent in each pipeline pass in this process, summed over compiled graphs (``engine.get_compile_time()``).
opt_pass_times: Dict[str, float] = {}


def register_compile_pass(name: str, opt_pass_fn: Callable, contract: Optional[PassContract] = None) -> None:
    opt_passes[name] = opt_pass_fn
    if contract is None:
        CONTRACTS.pop(name, None)
    else:
        CONTRACTS[name] = contract


def cleanup_compiled_backward_state(frame_id=None, owned_frames=None) -> None:
    """Part of the engine's API. This module keeps no per-frame backward state outside the engine's runtime
    (released by the runtime itself), so there is nothing to clean up here."""
