# SPDX-License-Identifier: Apache-2.0
"""Entry points only: the stock DeepCompile pass names that DeepSpeed's engine imports from here and registers at
start-up (``from deepspeed.compile.passes import zero3_compile, prefetch, ...``, then ``NAME``, a callable and a
``CONTRACT`` from each). None of them runs here: each callable raises, saying that this module runs its own fixed
pipeline (``driver/compiler.py``). The real graph passes live in ``deepspeed.compile.graph`` (analysis, tagging,
rewrites) and ``deepspeed.compile.schedule`` (ordering); ``contract.py`` is the schedule validation the engine
calls."""
from types import SimpleNamespace

from .contract import CAP_Z3_GATHER_RELEASE, PassContract, not_in_pipeline

_AFTER_GATHERS = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))


def _stock(**names) -> SimpleNamespace:
    """One stock pass module as the engine reads it: its names, contracts, and a refusing callable per pass name
    (``callables``: attribute -> the pass name it stands for)."""
    callables = names.pop("callables")
    return SimpleNamespace(**names, **{attr: not_in_pipeline(name) for attr, name in callables.items()})


zero_1_and_2_compile = _stock(NAME_Z1="zero1_compile", NAME_Z2="zero2_compile",
                              CONTRACT_Z1=PassContract(conflicts_with=frozenset({"zero3_compile"})),
                              CONTRACT_Z2=PassContract(conflicts_with=frozenset({"zero3_compile", "zero1_compile"})),
                              callables={"add_z1_reduce": "zero1_compile", "add_z2_reduce": "zero2_compile"})
zero3_compile = _stock(NAME="zero3_compile", CONTRACT=PassContract(provides=frozenset({CAP_Z3_GATHER_RELEASE})),
                       callables={"add_z3_gather_release": "zero3_compile"})
prefetch = _stock(NAME="prefetch", CONTRACT=_AFTER_GATHERS, callables={"schedule_prefetch": "prefetch"})
selective_gather = _stock(NAME="selective_gather", CONTRACT=_AFTER_GATHERS,
                          callables={"selective_gather": "selective_gather"})
offload_parameters = _stock(NAME="offload_parameters", CONTRACT=_AFTER_GATHERS,
                            callables={"offload_parameter_fwd": "offload_parameters"})
offload_adam_states = _stock(NAME="offload_adam_states", NAME_SYNC="offload_adam_states_sync",
                             NAME_FOR_INIT="offload_adam_states_for_init", CONTRACT=PassContract(),
                             CONTRACT_SYNC=PassContract(conflicts_with=frozenset({"offload_adam_states"})),
                             CONTRACT_FOR_INIT=PassContract(),
                             callables={"move_opt_states": "offload_adam_states",
                                        "move_opt_states_sync": "offload_adam_states_sync",
                                        "offload_adam_states_for_init": "offload_adam_states_for_init"})
offload_activation = _stock(NAME="offload_activation", FLOOR_NAME="offload_activation_floor", CONTRACT=PassContract(),
                            callables={"offload_activation": "offload_activation",
                                       "offload_activation_floor": "offload_activation_floor"})
