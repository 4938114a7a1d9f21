# SPDX-License-Identifier: Apache-2.0
"""Engine-facing name for stock parameter offload, which this module does not implement."""
from .contract import CAP_Z3_GATHER_RELEASE, PassContract, not_in_pipeline

NAME = "offload_parameters"
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))
offload_parameter_fwd = not_in_pipeline(NAME)
