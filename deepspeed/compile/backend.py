# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name): the stock pass registry and the compile-time view.

The engine registers its stock pass names at start-up and reads ``opt_passes`` to resolve a schedule. This
module's pipeline is fixed (``engine_state.activate_z3`` builds the dynamo backend per engine), so the registry
holds the stock names only, each a stub that says so (``passes/``), and is read-only.
"""
from typing import Callable, Optional

from .engine_state import PassTimes
from .passes import (offload_activation, offload_adam_states, offload_parameters, prefetch, selective_gather,
                     zero3_compile, zero_1_and_2_compile)
from .passes.contract import PassContract, PassRegistry

opt_passes = PassRegistry([
    (zero_1_and_2_compile.NAME_Z1, zero_1_and_2_compile.add_z1_reduce, zero_1_and_2_compile.CONTRACT_Z1),
    (zero_1_and_2_compile.NAME_Z2, zero_1_and_2_compile.add_z2_reduce, zero_1_and_2_compile.CONTRACT_Z2),
    (zero3_compile.NAME, zero3_compile.add_z3_gather_release, zero3_compile.CONTRACT),
    (prefetch.NAME, prefetch.schedule_prefetch, prefetch.CONTRACT),
    (selective_gather.NAME, selective_gather.selective_gather, selective_gather.CONTRACT),
    (offload_parameters.NAME, offload_parameters.offload_parameter_fwd, offload_parameters.CONTRACT),
    (offload_adam_states.NAME, offload_adam_states.move_opt_states, offload_adam_states.CONTRACT),
    (offload_activation.FLOOR_NAME, offload_activation.offload_activation_floor, offload_activation.CONTRACT),
    (offload_activation.NAME, offload_activation.offload_activation, offload_activation.CONTRACT),
    (offload_adam_states.NAME_SYNC, offload_adam_states.move_opt_states_sync, offload_adam_states.CONTRACT_SYNC),
    (offload_adam_states.NAME_FOR_INIT, offload_adam_states.offload_adam_states_for_init,
     offload_adam_states.CONTRACT_FOR_INIT),
])

# Seconds per pipeline pass, summed over this process's live engines (``engine.get_compile_time()``).
opt_pass_times = PassTimes()


def register_compile_pass(name: str, opt_pass_fn: Callable, contract: Optional[PassContract] = None) -> None:
    """The engine registers the stock passes at start-up: those are already here. Any other pass could never run
    (this module does not run pass schedules), so registering one is refused at once, naming it."""
    if opt_passes.get(name) is opt_pass_fn and opt_passes.contracts.get(name) == (contract or PassContract()):
        return
    raise ValueError(f"register_compile_pass({name!r}): deepspeed-compile runs a fixed pipeline configured in the "
                     "ds_config 'compile' section and never runs registered passes")


def cleanup_compiled_backward_state(frame_id=None, owned_frames=None) -> None:
    """Part of the engine's API. This module keeps no per-frame backward state outside the engine's runtime
    (released by the runtime itself), so there is nothing to clean up here."""
