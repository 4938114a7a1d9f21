# SPDX-License-Identifier: Apache-2.0
"""Engine adapters only: the stock DeepCompile pass names that DeepSpeed's engine imports and registers at start-up
(``NAME``, a callable, a ``CONTRACT`` per module). None of them runs here: each callable raises, saying that this
module runs its own fixed pipeline. The real graph passes live in ``deepspeed.compile.graph`` (analysis, tagging,
rewrites) and ``deepspeed.compile.schedule`` (ordering)."""
