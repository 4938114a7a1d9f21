# SPDX-License-Identifier: Apache-2.0
"""Side-by-side benchmark of DeepCompile for ZeRO-3 against eager ZeRO-3, plain torch.compile and FSDP2."""
