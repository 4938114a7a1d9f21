# SPDX-License-Identifier: Apache-2.0
"""Engine-facing names for stock ZeRO-1/2 DeepCompile, which this module does not implement (see init_z1_and_2)."""
from .contract import PassContract, not_in_pipeline

NAME_Z1 = "zero1_compile"
NAME_Z2 = "zero2_compile"
CONTRACT_Z1 = PassContract(conflicts_with=frozenset({"zero3_compile"}))
CONTRACT_Z2 = PassContract(conflicts_with=frozenset({"zero3_compile", NAME_Z1}))
add_z1_reduce = not_in_pipeline(NAME_Z1)
add_z2_reduce = not_in_pipeline(NAME_Z2)
