# SPDX-License-Identifier: Apache-2.0
"""What calling one of our graph ops costs through the dispatcher, as inductor's generated code calls it: the
``custom_op`` each pass sees against its ``dsc::run_*`` twin (``runtime/ops.py``), with the runtime's work taken out.
And what a small ATen op costs from the eager backend's graph code: through its ``OpOverload``, as FX writes it
(``torch.ops.aten.add.Tensor(...)``), against the C++ function behind it, as the eager backend calls it
(``driver/eager_code.direct_op_calls``).

    python benchmarks/op_dispatch.py [--calls 20000]

Runs under ``torch.no_grad`` (compiled graphs run there) with parameter inputs that require grad, as in a graph.
Prints microseconds per call for each op and each form.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "unit",
                                "compile"))
import checkout  # noqa: E402,F401  (this checkout's deepspeed.compile)

import torch  # noqa: E402
from deepspeed.compile.runtime import ops, registry  # noqa: E402


class _Idle:
    """A runtime that does nothing: what is left is the cost of reaching it."""

    def __init__(self):
        self.gathered = torch.empty(64)  # not the input: custom_op checks that an output aliases none

    def gather(self, standin, ds_id, dtype, plan):
        return self.gathered

    def release(self, gathered, ds_id):
        return None

    def reduce_op(self, grad, ds_id, param):
        return None


def per_call(op, args, calls: int) -> float:
    for _ in range(calls // 10):
        op(*args)
    start = time.perf_counter()
    for _ in range(calls):
        op(*args)
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000)
    calls = p.parse_args().calls
    idle = _Idle()  # the registry holds runtimes weakly
    rid = registry.register(idle)
    param = torch.nn.Parameter(torch.randn(64))
    grad = torch.randn(64)
    cases = {ops.GATHER: (param, rid, 0, None, [], ""), ops.RELEASE: (param.detach(), rid, 0, []),
             ops.REDUCE: (grad, rid, 0, param, [])}
    with torch.no_grad():
        for op, args in cases.items():
            traced, untraced = per_call(op, args, calls), per_call(ops.UNTRACED_CALLS[op], args, calls)
            print(f"{op._schema.name:20s} custom_op {traced * 1e6:6.1f} us   run_ twin {untraced * 1e6:6.1f} us   "
                  f"({traced / untraced:.1f}x)")
        x, y = torch.randn(64), torch.randn(64)
        aten = per_call(lambda a, b: torch.ops.aten.add.Tensor(a, b), (x, y), calls)
        add = torch.ops.aten.add.Tensor._op  # a global of the graph's code, as the eager backend binds it
        direct = per_call(lambda a, b: add(a, b), (x, y), calls)  # both called from a Python frame
        print(f"{'aten::add.Tensor':20s} torch.ops  {aten * 1e6:6.1f} us   direct    {direct * 1e6:6.1f} us   "
              f"({aten / direct:.1f}x)")


if __name__ == "__main__":
    main()
