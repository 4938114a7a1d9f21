# SPDX-License-Identifier: Apache-2.0
"""Graph analysis and rewrite passes of the ZeRO-3 pipeline: tag -> partition -> rewrite (-> schedule)."""
