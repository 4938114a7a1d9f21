"""The graph ops of deepspeed-compile: the single entry point to them (``torch.ops.dsc.*``).

Each op carries the id of the runtime that owns it (see ``registry``) and a parameter's ``ds_id``; the work is
done by that runtime. Ops with no result declare the mutation they really perform (``release_param`` frees the
gathered buffer's storage, ``reduce_grad`` consumes the gradient) so that no compiler drops or reorders them
across their data.
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import registry

NAMESPACE = "dsc"


@torch.library.custom_op("dsc::gather_param", mutates_args=())
def gather_param(standin: Tensor, runtime_id: int, ds_id: int, dtype: Optional[torch.dtype],
                 after: List[Tensor], plan: str) -> Tensor:
    """All-gather parameter ``ds_id`` to its full shape, cast to ``dtype`` first (before sending) unless None.
    ``standin`` is the parameter as the graph sees it: it orders the op after the graph input. ``dtype`` has no
    default on purpose: compilers drop default arguments from nodes, and the rewrite sets it in place.
    ``after`` pins the gather after the ops that produce these tensors (the schedule's order survives any
    backend's own reordering as a data dependency). ``plan``: empty, or the run of gathers this one starts and
    the run after it (``coalesce_gathers_pass``, :func:`encode_plan`): the run is gathered in one collective and
    the next run's collective is started ahead. Text, not lists of ints (inductor's generated code drops the
    contents of list arguments), and not an id the compiler registers with the runtime: a graph loaded from
    torch's compile caches never ran our compiler, so each op must say all it needs."""
    return run_gather(standin, runtime_id, ds_id, dtype, after, plan)


def run_gather(standin: Tensor, runtime_id: int, ds_id: int, dtype: Optional[torch.dtype], after: List[Tensor],
               plan: str) -> Tensor:
    """What ``gather_param`` does, as a plain function: the eager backend's final graphs call it directly
    (``PLAIN_CALLS``), past the dispatcher, since nothing traces or differentiates them any more."""
    return registry.lookup(runtime_id).gather(ds_id, dtype, plan)


@gather_param.register_fake
def _(standin: Tensor, runtime_id: int, ds_id: int, dtype: Optional[torch.dtype], after: List[Tensor],
      plan: str) -> Tensor:
    return standin.new_empty(standin.shape, dtype=dtype or standin.dtype)


def _gather_setup_context(ctx, inputs, output) -> None:
    ctx.num_after = len(inputs[4])


def _gather_backward(ctx, grad: Tensor):
    # The gathered tensor is the parameter itself: its gradient flows to the parameter input unchanged,
    # where the backward rewrite replaces it by an in-graph reduce-scatter.
    return grad, None, None, None, [None] * ctx.num_after, None


gather_param.register_autograd(_gather_backward, setup_context=_gather_setup_context)


@torch.library.custom_op("dsc::release_param", mutates_args=("gathered",))
def release_param(gathered: Tensor, runtime_id: int, ds_id: int, after: List[Tensor]) -> None:
    """Drop one reference to the gathered parameter; the last one frees its storage. ``after`` are the outputs
    of every op that reads the gathered tensor or its views: a data dependency, so no backend's scheduler can
    run the release before a reader (inductor does not order a mutation after fused readers by itself)."""
    run_release(gathered, runtime_id, ds_id, after)


def run_release(gathered: Tensor, runtime_id: int, ds_id: int, after: List[Tensor]) -> None:
    registry.lookup(runtime_id).release(ds_id, gathered)


@release_param.register_fake
def _(gathered: Tensor, runtime_id: int, ds_id: int, after: List[Tensor]) -> None:
    return None


@torch.library.custom_op("dsc::reduce_grad", mutates_args=("grad",))
def reduce_grad(grad: Tensor, runtime_id: int, ds_id: int) -> None:
    """Queue the full gradient of parameter ``ds_id`` for a bucketed reduce-scatter into its ZeRO partition."""
    run_reduce(grad, runtime_id, ds_id)


def run_reduce(grad: Tensor, runtime_id: int, ds_id: int) -> None:
    registry.lookup(runtime_id).reduce(ds_id, grad)


@reduce_grad.register_fake
def _(grad: Tensor, runtime_id: int, ds_id: int) -> None:
    return None


Run = Sequence[Tuple[int, Optional[torch.dtype]]]  # a run of coalesced gathers: (ds_id, gather dtype or None)


def encode_plan(run: Run, following: Run) -> str:
    """The ``plan`` argument of a run's first gather: ``"ds_id:dtype,...|ds_id:dtype,..."``, this run and then the
    one its collective starts ahead (empty after the last run); a dtype is empty for the parameter's own."""
    def part(members: Run) -> str:
        return ",".join(f"{ds_id}:{str(dtype).split('.')[-1] if dtype is not None else ''}" for ds_id, dtype in members)
    return f"{part(run)}|{part(following)}"


def decode_plan(plan: str) -> Tuple[Run, Run]:
    """The two runs :func:`encode_plan` wrote."""
    def part(text: str) -> Run:
        members = []
        for item in filter(None, text.split(",")):
            ds_id, dtype = item.split(":")
            members.append((int(ds_id), getattr(torch, dtype) if dtype else None))
        return tuple(members)
    run, following = plan.split("|")
    return part(run), part(following)


GATHER = torch.ops.dsc.gather_param.default
RELEASE = torch.ops.dsc.release_param.default
REDUCE = torch.ops.dsc.reduce_grad.default

# each op's plain function, for graphs that run as Python (the eager backend) once every pass is done
PLAIN_CALLS = {GATHER: run_gather, RELEASE: run_release, REDUCE: run_reduce}
