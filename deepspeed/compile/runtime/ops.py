# SPDX-License-Identifier: Apache-2.0
"""The graph ops of deepspeed-compile: the single entry point to them (``torch.ops.dsc.*``).

Each op carries the id of the runtime that owns it (see ``registry``) and the ``ds_id`` of the parameter the graph
was traced with; the work is done by that runtime. At run time an op finds its parameter from the tensors it is
given, never from the ``ds_id``: a gather from its stand-in input, a release from the gathered tensor, a reduce
from the parameter input it is handed, a run of coalesced gathers from its first member (``GatherRuns.run``, runtime/z3_runs.py).
So one compiled graph serves every module of the same code (dynamo reuses a graph for every block of a model it
compiles block by block, its guards being on metadata), each call on its own parameters. The ``ds_id`` names the traced parameter for the compiler's passes and reports.
Ops with no result declare the mutation they really perform (``release_param`` frees the gathered buffer's
storage, ``reduce_grad`` consumes the gradient) so that no compiler drops or reorders them across their data.
The attention ops at the end (``causal_flag``, ``attention``) need no runtime: SDPA's CPU kernel, with its causal
form chosen at run time.
"""
import itertools
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import effects
from . import registry

NAMESPACE = "dsc"


@effects.custom_op("dsc::gather_param", mutates_args=())
def gather_param(standin: Tensor, runtime_id: int, ds_id: int, dtype: Optional[torch.dtype],
                 after: List[Tensor], plan: str) -> Tensor:
    """All-gather the parameter ``standin`` stands in for to its full shape, cast to ``dtype`` first (before
    sending) unless None. ``standin`` is the parameter as the graph sees it (the graph input): the runtime finds the
    parameter from it, and it orders the op after the input. ``dtype`` has no
    default on purpose: compilers drop default arguments from nodes, and the rewrite sets it in place.
    ``after`` pins the gather after the ops that produce these tensors (the schedule's order survives any
    backend's own reordering as a data dependency). ``plan``: empty, or the run of gathers this one starts and
    the run after it (``coalesce_gathers_pass``, :func:`encode_plan`): the run is gathered in one collective and
    the next run's collective is started ahead. The plan names the traced parameters; a graph serving another
    module of the same code maps them by name, relative to this op's own parameter (``GatherRuns.run``, runtime/z3_runs.py). Text,
    not lists (inductor's generated code drops the contents of a gather's list arguments: ints, and graph inputs
    too), and not an id the compiler registers with the runtime: a graph loaded from torch's compile caches never
    ran our compiler, so each op must say all it needs."""
    return run_gather(standin, runtime_id, ds_id, dtype, after, plan)


def run_gather(standin: Tensor, runtime_id: int, ds_id: int, dtype: Optional[torch.dtype], after: List[Tensor],
               plan: str) -> Tensor:
    """What ``gather_param`` does, as a plain function: the eager backend's final graphs call it directly
    (``PLAIN_CALLS``), past the dispatcher, since nothing traces or differentiates them any more."""
    return registry.lookup(runtime_id).gather(standin, ds_id, dtype, plan)


@gather_param.register_fake
def _gather_fake(standin: Tensor, runtime_id: int, ds_id: int, dtype: Optional[torch.dtype], after: List[Tensor],
      plan: str) -> Tensor:
    return standin.new_empty(standin.shape, dtype=dtype or standin.dtype)


def _gather_setup_context(ctx, inputs, output) -> None:
    ctx.num_after = len(inputs[4])
    ctx.save_for_backward(inputs[0])


def _gather_backward(ctx, grad: Tensor):
    # The gathered tensor is the parameter itself: its gradient flows to the parameter input unchanged, through
    # ``param_grad``, which names the parameter (the stand-in): the backward rewrite turns it into an in-graph
    # reduce-scatter of that parameter, and the partition keeps the stand-in for backward to name it there.
    standin, = ctx.saved_tensors
    return param_grad(grad, standin), None, None, None, [None] * ctx.num_after, None


@effects.custom_op("dsc::param_grad", mutates_args=())
def param_grad(grad: Tensor, standin: Tensor) -> Tensor:
    """The gradient of the parameter ``standin`` stands in for: only a marker in the traced backward, which
    ``rewrite.insert_reduces_pass`` replaces by ``reduce_grad(grad, ..., standin)``; run as it is, a copy."""
    return grad.clone()


@param_grad.register_fake
def _(grad: Tensor, standin: Tensor) -> Tensor:
    return torch.empty_like(grad)


gather_param.register_autograd(_gather_backward, setup_context=_gather_setup_context)


@effects.custom_op("dsc::release_param", mutates_args=("gathered",))
def release_param(gathered: Tensor, runtime_id: int, ds_id: int, after: List[Tensor]) -> None:
    """Drop one reference to the gathered parameter (the runtime finds it from the tensor); the last one frees its
    storage. ``after`` are the outputs
    of every op that reads the gathered tensor or its views: a data dependency, so no backend's scheduler can
    run the release before a reader (inductor does not order a mutation after fused readers by itself)."""
    run_release(gathered, runtime_id, ds_id, after)


def run_release(gathered: Tensor, runtime_id: int, ds_id: int, after: List[Tensor]) -> None:
    registry.lookup(runtime_id).release(gathered, ds_id)


@release_param.register_fake
def _release_fake(gathered: Tensor, runtime_id: int, ds_id: int, after: List[Tensor]) -> None:
    return None


@effects.custom_op("dsc::reduce_grad", mutates_args=("grad",))
def reduce_grad(grad: Tensor, runtime_id: int, ds_id: int, param: Optional[Tensor], after: List[Tensor]) -> None:
    """Queue the full gradient of a parameter for a bucketed reduce-scatter into its ZeRO partition. ZeRO-3: the
    parameter is the one ``param`` (its stand-in, a graph input) stands in for. ZeRO-1/2 (``param`` None): the
    runtime's parameter ``ds_id`` (the graph is bound to its traced parameters, ``compiler.bind_to_traced_params``).
    ``after``: empty, or, in inductor's final graphs, the tensor of the collective op before it
    (``rewrite.chain_collectives_pass``), so that inductor keeps the graph's collective order."""
    run_reduce(grad, runtime_id, ds_id, param, after)


def run_reduce(grad: Tensor, runtime_id: int, ds_id: int, param: Optional[Tensor], after: List[Tensor]) -> None:
    registry.lookup(runtime_id).reduce_op(grad, ds_id, param)


def run_reduce_owned(grad: Tensor, runtime_id: int, ds_id: int, param: Optional[Tensor], after: List[Tensor]) -> None:
    """``run_reduce`` of a gradient whose storage nothing else in the graph reads (the eager backend's graphs,
    ``graph/in_place.py``): the runtime may reduce it where it lies, writing into it, instead of copying it first."""
    registry.lookup(runtime_id).reduce_op(grad, ds_id, param, owned=True)


@reduce_grad.register_fake
def _reduce_fake(grad: Tensor, runtime_id: int, ds_id: int, param: Optional[Tensor], after: List[Tensor]) -> None:
    return None


def gradient_wanted(param: Tensor) -> bool:
    """Whether the backward running now accumulates ``param``'s gradient: ``loss.backward()`` does,
    ``torch.autograd.grad(loss, inputs)`` and ``backward(inputs=...)`` without it do not. A compiled backward computes
    every gradient its graph has (autograd drops those it was not asked for), so a reduce must ask: else an input
    gradient taken for an adversarial step would train the parameters too. Outside autograd's engine (nothing to ask)
    it is. ``torch.autograd.grad`` asking for the parameter's own gradient raises: the backward hands it to ZeRO and
    returns none, so autograd would answer None."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
    except RuntimeError as err:
        if "backward pass" in str(err):  # not inside a backward of autograd's engine
            return True
        # autograd's engine refuses the question for a leaf that torch.autograd.grad captures: this parameter
        raise RuntimeError(
            "deepspeed-compile: torch.autograd.grad() asked for the gradient of a parameter of a DeepCompile engine. "
            "Its compiled backward hands each parameter's gradient to ZeRO and returns none, so the answer would be "
            "None. Take parameter gradients with engine.backward() (read them with "
            "deepspeed.utils.safe_get_full_grad), or run this model without DeepCompile") from err


@effects.custom_op("dsc::reduce_grad_mm", mutates_args=())
def reduce_grad_mm(mat1: Tensor, mat2: Tensor, runtime_id: int, ds_id: int, param: Optional[Tensor],
                   after: List[Tensor]) -> Tensor:
    """``reduce_grad(mm(mat1, mat2), runtime_id, ds_id, param, after)`` as one op (``rewrite.fuse_matmul_reduces_pass``,
    ZeRO-1/2): the runtime computes the product where the gradient goes, ZeRO-2's reduce bucket, instead of into a
    buffer of the graph's that is then copied there, and not at all when autograd does not want the gradient. The
    result is an empty tensor, a token: what the next collective of inductor's graphs waits for (a reduce's own
    gradient plays that part, ``rewrite.chain_collectives_pass``). The op is registered as having a side effect, so no
    compiler drops it for its unused result."""
    return run_reduce_mm(mat1, mat2, runtime_id, ds_id, param, after)


def run_reduce_mm(mat1: Tensor, mat2: Tensor, runtime_id: int, ds_id: int, param: Optional[Tensor],
                  after: List[Tensor]) -> Tensor:
    registry.lookup(runtime_id).reduce_product_op(mat1, mat2, ds_id, param)
    return mat1.new_empty(0)


@reduce_grad_mm.register_fake
def _reduce_mm_fake(mat1: Tensor, mat2: Tensor, runtime_id: int, ds_id: int, param: Optional[Tensor],
                    after: List[Tensor]) -> Tensor:
    return mat1.new_empty(0)


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
REDUCE_MM = torch.ops.dsc.reduce_grad_mm.default
PARAM_GRAD = torch.ops.dsc.param_grad.default

# each op's plain function, for graphs that run as Python (the eager backend) once every pass is done
PLAIN_CALLS = {GATHER: run_gather, RELEASE: run_release, REDUCE: run_reduce, REDUCE_MM: run_reduce_mm}

# Each op again, as ``dsc::run_<name>``: the same schema and function, for inductor's final graphs, which call ops
# through the dispatcher. ``custom_op`` wraps an op in the layers tracing needs (an autograd kernel, default
# filling, an aliasing check of the outputs, dynamo's disable), each in Python: several times the cost of a call
# to the same function registered with ``torch.library.Library``, whose autograd and version-counter handling are
# the dispatcher's C++ fallbacks (``python benchmarks/op_dispatch.py``; figures in docs/benchmarks.md); a ZeRO-3
# step calls several hundred. The twins go into a graph only in its last pass (``GraphCompiler._lowering``):
# nothing traces or differentiates it after that, and inductor reads the same schema (mutated arguments included)
# as from the op each replaces, so it orders and keeps them as it did those.
_LIBRARY = effects.op_library(NAMESPACE)


def _untraced_twin(op: torch._ops.OpOverload, run, fake) -> torch._ops.OpOverload:
    """``op``'s schema under the name ``run_<name>``, with ``run`` as its kernel and ``op``'s fake."""
    name = f"run_{op._schema.name.split('::')[1]}"
    _LIBRARY.define(name + str(op._schema)[len(op._schema.name):])
    _LIBRARY.impl(name, run, "CompositeExplicitAutograd")
    effects.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.dsc, name).default


UNTRACED_CALLS = {GATHER: _untraced_twin(GATHER, run_gather, _gather_fake),
                  RELEASE: _untraced_twin(RELEASE, run_release, _release_fake),
                  REDUCE: _untraced_twin(REDUCE, run_reduce, _reduce_fake),
                  REDUCE_MM: _untraced_twin(REDUCE_MM, run_reduce_mm, _reduce_mm_fake)}
for _op in (REDUCE_MM, UNTRACED_CALLS[REDUCE_MM]):  # its effect is the reduction, not its (token) result
    effects.mark_side_effect(_op)


# ----- sequence parallelism: the collectives of the sequence group (``graph/sequence.py`` places them) ---------
# Each carries the id of the runtime whose sequence group (:class:`~.sequence.SequenceGroup`) it runs on. Their
# gradients are the adjoint collectives, so a gradient summed over the group is the gradient of the unsharded model,
# times the group's size ([Note: gradients of a sharded sequence] in graph/sequence.py). An op that joins blocks is
# told the joined size (``joined``, the sequence length's symbol where it joins the sequence): tracing then gives its
# result the size the rest of the graph was traced with, which ``size * (length // size)`` would not be.
def _sequence_group(runtime_id: int):
    return registry.lookup(runtime_id).sequence


@effects.custom_op("dsc::seq_all_to_all", mutates_args=())
def seq_all_to_all(x: Tensor, runtime_id: int, scatter_dim: int, gather_dim: int, joined: int) -> Tensor:
    """Split ``x`` along ``scatter_dim`` into one block per rank of the group, send block i to rank i, and join what
    each rank sent along ``gather_dim`` (to ``joined``), in rank order (Ulysses' exchange of heads for sequence)."""
    return _sequence_group(runtime_id).all_to_all(x, scatter_dim, gather_dim)


@seq_all_to_all.register_fake
def _(x: Tensor, runtime_id: int, scatter_dim: int, gather_dim: int, joined: int) -> Tensor:
    shape = list(x.shape)
    shape[scatter_dim] = shape[scatter_dim] // _sequence_group(runtime_id).size
    shape[gather_dim] = joined
    return x.new_empty(shape)


def _all_to_all_context(ctx, inputs, output) -> None:
    x, ctx.runtime_id, ctx.scatter_dim, ctx.gather_dim, _ = inputs
    ctx.split = x.shape[ctx.scatter_dim]


def _all_to_all_backward(ctx, grad: Tensor):
    """The reverse exchange: the gradient of each block goes back to the rank that sent it."""
    return seq_all_to_all(grad, ctx.runtime_id, ctx.gather_dim, ctx.scatter_dim, ctx.split), None, None, None, None


seq_all_to_all.register_autograd(_all_to_all_backward, setup_context=_all_to_all_context)


@effects.custom_op("dsc::seq_all_gather", mutates_args=())
def seq_all_gather(x: Tensor, runtime_id: int, dim: int, joined: int) -> Tensor:
    """Every rank's block of the sequence, joined along ``dim`` (to ``joined``) in rank order."""
    return _sequence_group(runtime_id).all_gather(x, dim)


@effects.custom_op("dsc::seq_reduce_scatter", mutates_args=())
def seq_reduce_scatter(x: Tensor, runtime_id: int, dim: int) -> Tensor:
    """The sum of ``x`` over the group, this rank's block of it along ``dim``."""
    return _sequence_group(runtime_id).reduce_scatter(x, dim)


@seq_all_gather.register_fake
def _(x: Tensor, runtime_id: int, dim: int, joined: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = joined
    return x.new_empty(shape)


@seq_reduce_scatter.register_fake
def _(x: Tensor, runtime_id: int, dim: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] // _sequence_group(runtime_id).size
    return x.new_empty(shape)


def _all_gather_context(ctx, inputs, output) -> None:
    ctx.runtime_id, ctx.dim = inputs[1], inputs[2]


def _reduce_scatter_context(ctx, inputs, output) -> None:
    ctx.runtime_id, ctx.dim = inputs[1], inputs[2]
    ctx.joined = inputs[0].shape[ctx.dim]


def _all_gather_backward(ctx, grad: Tensor):
    """Each rank's gradient of the whole value, summed over the group: this rank's block of it."""
    return seq_reduce_scatter(grad, ctx.runtime_id, ctx.dim), None, None, None


def _reduce_scatter_backward(ctx, grad: Tensor):
    return seq_all_gather(grad, ctx.runtime_id, ctx.dim, ctx.joined), None, None


seq_all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_context)
seq_reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_reduce_scatter_context)


@effects.custom_op("dsc::seq_all_reduce", mutates_args=())
def seq_all_reduce(x: Tensor, runtime_id: int) -> Tensor:
    """The sum of ``x`` over the group (each rank's addend: a loss summed over its block of the sequence)."""
    return _sequence_group(runtime_id).all_reduce(x)


@seq_all_reduce.register_fake
def _seq_all_reduce_fake(x: Tensor, runtime_id: int) -> Tensor:
    return torch.empty_like(x)


def _keep_runtime_id(ctx, inputs, output) -> None:
    ctx.runtime_id = inputs[1]


def _all_reduce_backward(ctx, grad: Tensor):
    """Every addend's gradient is the sum's, summed over the group (the ranks' shares of it)."""
    return seq_all_reduce(grad, ctx.runtime_id), None


seq_all_reduce.register_autograd(_all_reduce_backward, setup_context=_keep_runtime_id)

SEQ_ALL_TO_ALL = torch.ops.dsc.seq_all_to_all.default
SEQ_ALL_GATHER = torch.ops.dsc.seq_all_gather.default
SEQ_REDUCE_SCATTER = torch.ops.dsc.seq_reduce_scatter.default
SEQ_ALL_REDUCE = torch.ops.dsc.seq_all_reduce.default


# ----- tensor parallelism: the collectives of AutoTP's group (``graph/tensor.py`` places them) -----------------
# A column-parallel linear (AutoTP's ``LinearLayer``) reads the whole input and computes its block of the outputs: its
# input's gradient is a sum over the group (``tp_enter``). A row-parallel one (``LinearAllreduce``) reads its block of
# the inputs and computes a part of every output: the parts are summed (``tp_sum``). Megatron-LM's f and g.
def _tensor_group(runtime_id: int):
    return registry.lookup(runtime_id).tensor


@effects.custom_op("dsc::tp_enter", mutates_args=())
def tp_enter(x: Tensor, runtime_id: int) -> Tensor:
    """``x`` (a copy: an op may not return its input) entering a column-parallel linear; its gradient is summed over
    the tensor-parallel group."""
    return x.clone()


def _same_shape(x: Tensor, runtime_id: int) -> Tensor:
    return torch.empty_like(x)


tp_enter.register_fake(_same_shape)


def _tp_enter_backward(ctx, grad: Tensor):
    return tp_sum(grad, ctx.runtime_id), None


@effects.custom_op("dsc::tp_sum", mutates_args=())
def tp_sum(x: Tensor, runtime_id: int) -> Tensor:
    """The sum over the tensor-parallel group of each rank's part of a row-parallel linear's output."""
    return _tensor_group(runtime_id).all_reduce(x)


tp_sum.register_fake(_same_shape)


def _tp_sum_backward(ctx, grad: Tensor):
    """Each part's gradient is the sum's, on every rank."""
    return grad, None


tp_enter.register_autograd(_tp_enter_backward, setup_context=_keep_runtime_id)
tp_sum.register_autograd(_tp_sum_backward, setup_context=_keep_runtime_id)

TP_ENTER = torch.ops.dsc.tp_enter.default
TP_SUM = torch.ops.dsc.tp_sum.default


# A backward graph's ``tp_sum`` in two parts, around code that does not read the sum (``graph/tensor.py``): the sum
# is in flight over the group while that code runs. Placed after the partition, so neither is ever differentiated.
@effects.custom_op("dsc::tp_sum_start", mutates_args=())
def tp_sum_start(x: Tensor, runtime_id: int) -> Tensor:
    """The sum over the tensor-parallel group of ``x``, started: a new buffer, which holds the sum once
    ``tp_sum_wait`` returned for it."""
    return run_tp_sum_start(x, runtime_id)


def run_tp_sum_start(x: Tensor, runtime_id: int) -> Tensor:
    return _tensor_group(runtime_id).start_all_reduce(x)


@tp_sum_start.register_fake
def _tp_sum_start_fake(x: Tensor, runtime_id: int) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@effects.custom_op("dsc::tp_sum_wait", mutates_args=("total",))
def tp_sum_wait(total: Tensor, runtime_id: int) -> None:
    """Wait for the sum ``tp_sum_start`` started into ``total``. Declared as writing ``total``: no backend moves a
    reader of the sum before it."""
    run_tp_sum_wait(total, runtime_id)


def run_tp_sum_wait(total: Tensor, runtime_id: int) -> None:
    _tensor_group(runtime_id).finish_all_reduce(total)


@tp_sum_wait.register_fake
def _tp_sum_wait_fake(total: Tensor, runtime_id: int) -> None:
    return None


TP_SUM_START = torch.ops.dsc.tp_sum_start.default
TP_SUM_WAIT = torch.ops.dsc.tp_sum_wait.default
PLAIN_CALLS.update({TP_SUM_START: run_tp_sum_start, TP_SUM_WAIT: run_tp_sum_wait})
UNTRACED_CALLS.update({TP_SUM_START: _untraced_twin(TP_SUM_START, run_tp_sum_start, _tp_sum_start_fake),
                       TP_SUM_WAIT: _untraced_twin(TP_SUM_WAIT, run_tp_sum_wait, _tp_sum_wait_fake)})


# DeepSpeed's AutoTP ``LinearLayer`` with ``gather_output`` (a column-parallel head whose every rank needs the whole
# output), its collectives deferred, calls this op by name (``torch.ops.autotp.gather_from_tp_region``): stock
# DeepSpeed defines it in its own ``deepspeed.compile``, which this package stands in for, so it is defined here, on
# AutoTP's group (DeepSpeed's ``groups``). Every rank computes the same from the whole output, so the gradient of its
# block is its block of the gradient.
def _autotp_group():
    from deepspeed.utils import groups
    return groups.get_tensor_model_parallel_group()


@effects.custom_op("autotp::gather_from_tp_region", mutates_args=())
def autotp_gather(input: Tensor, partition_sizes: List[int]) -> Tensor:
    """The blocks of the last dimension of every rank of AutoTP's group (widths ``partition_sizes``), joined."""
    import torch.distributed as dist
    group = _autotp_group()
    widest = max(partition_sizes)
    padded = torch.nn.functional.pad(input, (0, widest - input.shape[-1])).contiguous()
    blocks = [torch.empty_like(padded) for _ in partition_sizes]
    dist.all_gather(blocks, padded, group=group)
    return torch.cat([block[..., :width] for block, width in zip(blocks, partition_sizes)], dim=-1)


@autotp_gather.register_fake
def _(input: Tensor, partition_sizes: List[int]) -> Tensor:
    return input.new_empty((*input.shape[:-1], sum(partition_sizes)))


def _autotp_gather_context(ctx, inputs, output) -> None:
    ctx.partition_sizes = list(inputs[1])


def _autotp_gather_backward(ctx, grad: Tensor):
    import torch.distributed as dist
    rank = dist.get_rank(group=_autotp_group())
    start = sum(ctx.partition_sizes[:rank])
    return grad.narrow(-1, start, ctx.partition_sizes[rank]).contiguous(), None


autotp_gather.register_autograd(_autotp_gather_backward, setup_context=_autotp_gather_context)


# ----- attention whose mask may be the causal one (``graph/masks.py`` places them) -----------------------------------
# A traced model builds its attention mask as a tensor wherever it cannot read values at trace time (``transformers``
# under tracing, a graph over a symbolic length): eagerly the same model would pass SDPA ``is_causal=True`` once it saw
# the mask was the causal one. These ops decide at run time instead, once per mask and graph run (``causal_flag``),
# and run CPU's fused attention kernel (the one SDPA itself calls there) causal or with the mask. Both branches are
# that kernel's, bitwise SDPA's, with the mask or with ``is_causal``.
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_CAUSAL_KEEP: Dict[Tuple[int, torch.device], Tensor] = {}  # the causal keep-mask of the last two lengths (L^2 bytes)


def _causal_keep(length: int, device: torch.device) -> Tensor:
    key = (length, device)
    if key not in _CAUSAL_KEEP:
        if len(_CAUSAL_KEEP) >= 2:
            _CAUSAL_KEEP.pop(next(iter(_CAUSAL_KEEP)))
        _CAUSAL_KEEP[key] = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return _CAUSAL_KEEP[key]


def _is_causal_square(square: Tensor, keep: Tensor) -> bool:
    if square.dtype == torch.bool:
        return torch.equal(square, keep)
    # an additive mask: 0 kept; masked, a value that vanishes in the softmax (-inf, or the dtype's lowest as
    # transformers writes it)
    if not torch.equal(square == 0, keep):
        return False
    low = torch.finfo(square.dtype).min / 2
    return bool((square.masked_fill(keep, low) <= low).all())


def is_causal_mask(mask: Tensor) -> bool:
    """Whether ``mask`` (SDPA's boolean keep-mask or its additive float form) is, for every batch row and head it
    broadcasts over, exactly the causal mask of a square attention: what ``is_causal=True`` applies."""
    length = mask.shape[-1]
    if mask.dim() < 2 or mask.shape[-2] != length or not (mask.dtype == torch.bool or mask.is_floating_point()):
        return False
    keep = _causal_keep(length, mask.device)
    rows = itertools.product(*(range(size) for size in mask.shape[:-2]))  # views: a broadcast mask is not copied
    return all(_is_causal_square(mask[row], keep) for row in rows)


@effects.custom_op("dsc::causal_flag", mutates_args=())
def causal_flag(mask: Tensor) -> Tensor:
    """:func:`is_causal_mask` of ``mask``, as a 0-dim bool tensor (the graph computes it once a run for every
    attention reading that mask)."""
    return torch.tensor(is_causal_mask(mask))


@causal_flag.register_fake
def _(mask: Tensor) -> Tensor:
    return mask.new_empty((), dtype=torch.bool)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """SDPA's own conversion of a boolean keep-mask before its fused kernel: 0 kept, -inf masked."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask.logical_not(), float("-inf"))


@effects.custom_op("dsc::attention", mutates_args=())
def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, causal: Tensor,
              scale: Optional[float]) -> Tuple[Tensor, Tensor]:
    """SDPA of ``query``, ``key``, ``value`` (``[batch, heads, length, dim]``, on CPU) under ``mask``, causal instead
    where ``causal`` (``causal_flag``) holds: the output and the kernel's log-sum-exp (for the backward)."""
    if bool(causal):  # the mask is square, and so is the attention it broadcasts to
        return _FLASH_CPU(query, key, value, 0.0, True, scale=scale)
    return _FLASH_CPU(query, key, value, 0.0, False, attn_mask=_additive(mask, query.dtype), scale=scale)


@attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, causal: Tensor,
      scale: Optional[float]) -> Tuple[Tensor, Tensor]:
    # the kernel's own meta function: its outputs' strides (a compiler checks them) are the kernel's
    return _FLASH_CPU(query, key, value, 0.0, True, scale=scale)


@effects.custom_op("dsc::attention_backward", mutates_args=())
def attention_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
                       mask: Tensor, causal: Tensor, scale: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``attention``'s query, key and value: the same kernel's backward, on the same branch."""
    if bool(causal):  # the mask is square, and so is the attention it broadcasts to
        return _FLASH_CPU_BACKWARD(grad.contiguous(), query, key, value, out, logsumexp, 0.0, True, scale=scale)
    return _FLASH_CPU_BACKWARD(grad.contiguous(), query, key, value, out, logsumexp, 0.0, False,
                               attn_mask=_additive(mask, query.dtype), scale=scale)


@attention_backward.register_fake
def _(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor, mask: Tensor,
      causal: Tensor, scale: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    return _FLASH_CPU_BACKWARD(grad.contiguous(), query, key, value, out, logsumexp, 0.0, True, scale=scale)


def _attention_context(ctx, inputs, output) -> None:
    query, key, value, mask, causal, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(query, key, value, output[0], output[1], mask, causal)


def _attention_grads(ctx, grad: Tensor, _grad_logsumexp):
    query, key, value, out, logsumexp, mask, causal = ctx.saved_tensors
    grads = attention_backward(grad, query, key, value, out, logsumexp, mask, causal, ctx.scale)
    return (*grads, None, None, None)


attention.register_autograd(_attention_grads, setup_context=_attention_context)

CAUSAL_FLAG = torch.ops.dsc.causal_flag.default
ATTENTION = torch.ops.dsc.attention.default
