# SPDX-License-Identifier: Apache-2.0
"""Engine-facing name for the prefetch pass (the engine registers it at start-up)."""
from .contract import CAP_Z3_GATHER_RELEASE, PassContract, not_in_pipeline

NAME = "prefetch"
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))
schedule_prefetch = not_in_pipeline(NAME)
