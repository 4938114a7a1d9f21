# SPDX-License-Identifier: Apache-2.0
"""Capture: let dynamo/AOTAutograd trace ZeRO-3 parameters with full shapes, and build the dynamo backend."""
