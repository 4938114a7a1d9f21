# SPDX-License-Identifier: Apache-2.0
"""The one generic pass runner: run a list of ``gm -> gm`` passes, time each, lint and recompile."""
import time
from typing import Callable, Dict, Sequence, Tuple

from torch.fx import GraphModule

Pass = Tuple[str, Callable[[GraphModule], GraphModule]]


def run_passes(gm: GraphModule, passes: Sequence[Pass], times: Dict[str, float]) -> GraphModule:
    for name, fn in passes:
        start = time.perf_counter()
        gm = fn(gm)
        gm.graph.lint()
        times[name] = times.get(name, 0.0) + time.perf_counter() - start
    gm.recompile()
    return gm
