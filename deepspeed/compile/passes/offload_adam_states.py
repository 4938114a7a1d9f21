# SPDX-License-Identifier: Apache-2.0
"""Engine-facing names for stock optimizer-state offload, which this module does not implement."""
from .contract import PassContract, not_in_pipeline

NAME = "offload_adam_states"
NAME_SYNC = "offload_adam_states_sync"
NAME_FOR_INIT = "offload_adam_states_for_init"
CONTRACT = PassContract()
CONTRACT_SYNC = PassContract(conflicts_with=frozenset({NAME}))
CONTRACT_FOR_INIT = PassContract()
move_opt_states = not_in_pipeline(NAME)
move_opt_states_sync = not_in_pipeline(NAME_SYNC)
offload_adam_states_for_init = not_in_pipeline(NAME_FOR_INIT)
