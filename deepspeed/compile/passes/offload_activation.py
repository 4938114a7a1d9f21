# SPDX-License-Identifier: Apache-2.0
"""Engine-facing names for stock activation offload, which this module does not implement."""
from .contract import PassContract, not_in_pipeline

NAME = "offload_activation"
FLOOR_NAME = "offload_activation_floor"
CONTRACT = PassContract()
offload_activation = not_in_pipeline(NAME)
offload_activation_floor = not_in_pipeline(FLOOR_NAME)
