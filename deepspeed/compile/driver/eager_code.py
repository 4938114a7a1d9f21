# SPDX-License-Identifier: Apache-2.0
"""The code the eager backend runs for a final graph (``compile.eager_graph_code``).

FX generates a graph's ``forward`` as Python source. Run as it is (``"fx"``), each call of a graph pays for CPython's
handling of a frame with a local per node and for ``OpOverload.__call__`` on every ATen op. ``"direct"`` (the
default) rewrites that source in two ways (what each saved: docs/history/2026-12-03.md and 2026-12-04.md): the
function becomes a generator, so its frame lives on the heap instead of CPython's data stack
(:func:`heap_frame_function`), and each ATen op is called through the C++ function behind its ``OpOverload``
(:func:`direct_op_calls`). The arithmetic is the same op by op: the two agree bit for bit (``test_passes.py``).
"""
import itertools
import linecache
import re
from typing import Any, Callable, Dict

import torch
from torch.fx import GraphModule

EAGER_GRAPH_CODE = ("direct", "fx")


def boxed_eager(gm: GraphModule, code: str = "direct") -> Callable:
    """Run the graph with the boxed calling convention: the generated code takes the argument list, clears it,
    and drops each input after its last use. Without this a backward graph keeps every saved activation alive
    until it returns (``make_boxed_func`` holds the list), where eager autograd frees them as it goes.
    ``code`` (``compile.eager_graph_code``): ``"direct"`` runs the code in a frame of its own on the heap, calling
    ATen ops past their ``OpOverload`` wrappers (:func:`heap_frame_function`); ``"fx"`` runs FX's generated
    ``forward`` as it is. Our ops are called as the graph names them: the plain functions behind them once the eager
    lowering has run (``GraphCompiler._lowering``)."""
    if code not in EAGER_GRAPH_CODE:
        raise ValueError(f"compile.eager_graph_code: one of {', '.join(EAGER_GRAPH_CODE)}, got {code!r}")
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())  # torch's own codegen for this convention
    gm.recompile()
    if code == "fx":
        def run_fx(args: list):
            return gm.forward(args)

        run_fx._boxed_call = True
        return run_fx
    body = heap_frame_function(gm)

    def run(args: list):
        frame = body(gm, args)
        try:
            next(frame)
        except StopIteration as done:
            return done.value
        raise AssertionError("a graph's code yielded")

    run._boxed_call = True
    return run


_graph_sources = itertools.count()


def heap_frame_function(gm: GraphModule) -> Callable:
    """The graph's generated ``forward``, made a generator function: called, it returns a generator whose one
    ``next()`` runs the whole graph and raises ``StopIteration`` with its result.

    Why: CPython (3.11 on) puts a plain call's frame on the thread's data stack, which grows in 16 KiB chunks mapped
    and unmapped as calls need them. A graph's function has a local per node (over a thousand in the benchmark
    Llama's backward), so where it leaves its chunk nearly full, every op it calls maps a fresh chunk and unmaps it
    on return: a page fault and two system calls per op, depending only on how deep the stack happened to be
    (docs/history/2026-12-03.md, "ZeRO-1/2: the eager backend's graphs off CPython's data stack"). A generator's
    frame lives in the generator object, so the graph's callees get the stack's room below it. Source lines stay in
    tracebacks (registered with ``linecache``). Its ATen ops are called directly (:func:`direct_op_calls`)."""
    code = gm.graph.python_code(root_module="self")
    lines = code.src.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("def forward("))
    lines.insert(at + 1, "    if False: yield  # a generator: its frame is kept in the generator object")
    namespace = dict(code.globals)
    source = direct_op_calls("\n".join(lines), gm, namespace)
    name = f"<deepspeed-compile graph {next(_graph_sources)}>"
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)
    exec(compile(source, name, "exec"), namespace)
    return namespace["forward"]


def direct_op_calls(source: str, gm: GraphModule, namespace: Dict[str, Any]) -> str:
    """The graph's source with each ATen op called through the C++ function behind its ``OpOverload``
    (``torch.ops.aten.mm.default(...)`` -> ``aten_mm_default(...)``, bound in ``namespace``): the same dispatcher
    call, without four attribute lookups and ``OpOverload.__call__``'s Python frame, on every op of the graph (a
    sizable part of what a small op costs from Python: ``benchmarks/op_dispatch.py`` measures it). Only plain
    ``OpOverload``s: a subclass (TorchBind ops) decides in Python how to dispatch."""
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function" and type(n.target) is torch._ops.OpOverload}
    scope = {}  # compiled once as it is (at compile time, not per call) for the names its code binds
    exec(compile(source, "<graph>", "exec"), dict(namespace), scope)
    taken = set(scope["forward"].__code__.co_varnames) | set(namespace)  # arguments, assigned variables, globals
    aliases = {}  # FX's spelling of an op -> the global it is called through
    for op in ops:
        qualified = torch.fx.node._get_qualified_name(op)
        alias = re.sub(r"\W", "_", qualified[len("torch.ops."):])
        if qualified.startswith("torch.ops.") and alias not in taken:  # else left as FX wrote it
            aliases[qualified], namespace[alias] = alias, op._op
            taken.add(alias)  # two spellings with one alias (aten.a_b.c, aten.a.b_c): the second stays as it is
    if not aliases:
        return source
    calls = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, aliases)) + r")\(")
    return calls.sub(lambda call: aliases[call.group(1)] + "(", source)
