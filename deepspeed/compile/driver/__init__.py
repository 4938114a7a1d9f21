# SPDX-License-Identifier: Apache-2.0
"""The compile driver: the dynamo backend, AOTAutograd with our partition and compilers, each backend's lowering, the
stage parts, regional compilation and the switch of ZeRO-3's eager hooks."""
