# SPDX-License-Identifier: Apache-2.0
"""Engine-facing name for the selective-gather pass (the engine registers it at start-up)."""
from .contract import CAP_Z3_GATHER_RELEASE, PassContract, not_in_pipeline

NAME = "selective_gather"
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))
selective_gather = not_in_pipeline(NAME)
