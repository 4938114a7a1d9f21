# SPDX-License-Identifier: Apache-2.0
"""Graphs for the pass and scheduler tests, no process group needed: a fake runtime behind the graph ops, small
traced graphs, and AOTAutograd forward / backward graphs of a GPT with the ZeRO-3 ops in traced order.

``capture`` partitions with the min-cut partitioner (parameter views tagged for recompute, as the capture stage
does), then ``insert_zero3_ops`` places the graph ops the way the rewrite passes do in traced order: every gather
right after the placeholders, each release after the last real use (seeing through views), a reduce after each
parameter gradient. The fake runtime makes the ops executable on CPU.
"""
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.func import functional_call
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from deepspeed.compile.graph.rewrite import insert_releases_pass
from deepspeed.compile.runtime import registry
from deepspeed.compile.runtime.ops import GATHER, REDUCE

from models import TinyGPT

aten = torch.ops.aten
# What the capture stage tags for recompute: views of parameters (enough for these models).
PARAM_VIEWS = {aten.t.default, aten.view.default, aten.slice.Tensor, aten.transpose.int, aten.permute.default,
               aten.expand.default}


class FakeRuntime:
    """Stands in for the ZeRO-3 runtime behind the graph ops: a gather returns a copy of the stored full tensor in
    the requested dtype, and a release poisons that copy. Every call is recorded in ``calls`` as ``(op, ds_id, detail)``: the gather's dtype, the
    released tensor's dtype, a copy of the reduced gradient. Registered on creation (``id``); the registry holds it
    weakly, so keep a reference as long as a graph that uses it runs."""

    def __init__(self, params: Union[Sequence[torch.Tensor], Mapping[int, torch.Tensor]]):
        self.params = params
        self.calls: List[Tuple[str, int, Any]] = []
        self.owned: List[int] = []  # ds_ids of the reduces told nothing else reads their gradient
        self.id = registry.register(self)

    def gather(self, standin: torch.Tensor, ds_id: int, dtype: Optional[torch.dtype], plan: str = "") -> torch.Tensor:
        self.calls.append(("gather", ds_id, dtype))  # by the traced ds_id: these graphs run on their own parameters
        param = self.params[ds_id]
        return param.detach().to(dtype or param.dtype, copy=True)

    def release(self, gathered: torch.Tensor, ds_id: int) -> None:
        """Poisons the released copy with NaN (the runtime frees it; reading freed storage could crash the test
        process): a reader scheduled after the release makes the graph's results differ."""
        self.calls.append(("release", ds_id, gathered.dtype))
        gathered.fill_(float("nan"))

    def reduce_op(self, grad: torch.Tensor, ds_id: int, param: Optional[torch.Tensor], owned: bool = False) -> None:
        self.calls.append(("reduce", ds_id, grad.clone()))
        if owned:
            self.owned.append(ds_id)

    def reduce_product_op(self, mat1: torch.Tensor, mat2: torch.Tensor, ds_id: int,
                          param: Optional[torch.Tensor]) -> None:
        """The fused ``reduce_grad_mm``: recorded as a reduce of the product, computed as the runtime computes it."""
        self.calls.append(("reduce", ds_id, torch.mm(mat1, mat2)))

    def ops(self) -> List[Tuple[str, int]]:
        """The calls as ``(op, ds_id)``, in order."""
        return [(op, ds_id) for op, ds_id, _ in self.calls]


def trace(fn, *shapes) -> GraphModule:
    """``fn`` traced by ``make_fx`` on fake tensors of the given shapes."""
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s) for s in shapes])


def clone(gm: GraphModule) -> GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


class Captured(NamedTuple):
    fw: GraphModule
    bw: GraphModule
    fw_args: list
    bw_args: list
    runtime: FakeRuntime


def insert_zero3_ops(gm: GraphModule, runtime_id: int, num_params: int, backward: bool) -> GraphModule:
    """Place gather/release (and in backward reduce) ops as the rewrite passes do, in traced order."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param_ids = {f"primals_{i + 1}": i for i in range(num_params)}
    anchor = placeholders[-1]
    for ph in placeholders:
        if ph.target not in param_ids:
            continue
        with graph.inserting_after(anchor):
            gather = graph.call_function(GATHER, (ph, runtime_id, param_ids[ph.target], None, [], ""))
        gather.meta["val"] = ph.meta["val"]
        ph.replace_all_uses_with(gather, delete_user_cb=lambda user, g=gather: user is not g and user.op != "output")
        anchor = gather
    insert_releases_pass(gm, runtime_id=runtime_id)  # the pipeline's own release placement
    if backward:
        grads = next(n for n in graph.nodes if n.op == "output").args[0]
        for ds_id, grad in enumerate(grads[:num_params]):
            if isinstance(grad, Node):
                with graph.inserting_after(grad):
                    graph.call_function(REDUCE, (grad, runtime_id, ds_id, None, []))
    graph.lint()
    gm.recompile()
    return gm


def capture(model: torch.nn.Module, inputs: tuple) -> Captured:
    """AOT forward and backward graphs of ``model``, with the ZeRO-3 graph ops in traced order."""
    names = [name for name, _ in model.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in model.named_parameters()]
    graphs: Dict[str, GraphModule] = {}

    def partition(joint, joint_inputs, **kwargs):
        primals = [n for n in joint.graph.nodes if n.op == "placeholder"][:len(params)]
        derived = set(primals)
        for node in joint.graph.nodes:
            if node.op == "call_function" and node.target in PARAM_VIEWS and node.args[0] in derived:
                derived.add(node)
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def keep(name):

        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm

        return compiler

    def run(*args):
        return functional_call(model, dict(zip(names, args[:len(params)])), args[len(params):])

    aot_function(run, keep("fw"), keep("bw"), partition_fn=partition)(*params, *inputs).backward()
    runtime = FakeRuntime([p.detach() for p in params])
    fw = insert_zero3_ops(graphs["fw"], runtime.id, len(params), backward=False)
    bw = insert_zero3_ops(graphs["bw"], runtime.id, len(params), backward=True)
    fw_args = [p.detach() for p in params] + list(inputs)
    with torch.no_grad():
        saved = list(fw(*fw_args))[1:]
    return Captured(fw, bw, fw_args, saved + [torch.ones(())], runtime)


def gpt_inputs(vocab: int, seq: int, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (2, seq), generator=generator),
            torch.randint(0, vocab, (2, seq), generator=generator))


def make_gpt(layers: int, dim: int, heads: int, vocab: int = 61, seq: int = 8) -> Captured:
    torch.manual_seed(0)
    return capture(TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq), gpt_inputs(vocab, seq))
