# SPDX-License-Identifier: Apache-2.0
"""Engine-facing name for the ZeRO-3 gather/release pass (the engine registers it at start-up)."""
from .contract import CAP_Z3_GATHER_RELEASE, PassContract, not_in_pipeline

NAME = "zero3_compile"
CONTRACT = PassContract(provides=frozenset({CAP_Z3_GATHER_RELEASE}))
add_z3_gather_release = not_in_pipeline(NAME)
