# SPDX-License-Identifier: Apache-2.0
"""The runtime behind the graph ops: parameter registry, gathered-buffer lifetime, gradient reduction."""
