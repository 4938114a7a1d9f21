# SPDX-License-Identifier: Apache-2.0
"""Real parameters for whatever runs outside the compiled graphs during a DeepCompile step.

While an engine's compiled forward runs, each ZeRO-3 parameter's ``.data`` is a full-shape stand-in with no real
contents (``runtime/standins.py``). Code that dynamo does not compile (a frame it skips after a graph break it
cannot resume from, a frame past ``recompile_limit``, a ``torch.compiler.disable``d submodule, an autograd
function it will not trace, Python between two graphs) reads the parameter as a plain tensor, so it must get the
real one. DeepSpeed's ``ZeROOrderedDict.__getitem__`` (every ``module.weight`` read) asks
``deepspeed.compile.z3_eager_fallback.get_active_z3_eager_fallback()`` for an object while a module is marked
``_in_forward``; with :class:`EagerAccess` active it gathers the parameter with ZeRO-3's own ``all_gather`` and
reports it here. The parameter then stays gathered until the step's backward has ended (autograd reads it
again there), and is partitioned again by :meth:`EagerAccess.release`.

Gradients of parameters used eagerly reach ``param.grad`` through autograd's ``AccumulateGrad`` (the compiled
graphs return ``None`` for their parameters instead). A post-accumulate-grad hook hands them to the runtime's
bucketed reduce-scatter, as ZeRO-3's own gradient hooks would. A gradient that arrives for a parameter that was
*not* gathered means eager code computed with the stand-in (it held the ``Parameter`` object and bypassed the
dict); the hook raises an error naming the parameter, before the optimizer step can apply anything.

The active object is a context variable, set for the duration of one engine's forward: several engines in one
process never see each other's.
"""
import contextvars
import logging
import types
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch.nn import Parameter
from torch.utils import _pytree as pytree

from .. import effects
from ..adapters import ModuleForward
from .z3_params import ShardedParams

log = logging.getLogger(__name__)

_ACTIVE: contextvars.ContextVar[Optional["EagerAccess"]] = contextvars.ContextVar("dsc_eager_access", default=None)


class StandinReadError(RuntimeError):
    """Eager code computed with a parameter's stand-in instead of the gathered parameter."""


def active() -> Optional["EagerAccess"]:
    return _ACTIVE.get()


def _dynamo_reasons() -> list:
    """Why dynamo did not compile something: the messages of its graph breaks and skipped frames so far, each its
    first line and, where dynamo gave one, its debug context (what it was tracing: "Attempted to mutate ...")."""
    from torch._dynamo.utils import counters
    reasons = (_reason(msg) for category in ("graph_break", "unimplemented") for msg in counters.get(category, {}))
    return list(dict.fromkeys(reason for reason in reasons if reason))


# the name of a block trampoline of ``regions: "blocks"`` (``driver/regions.py``), which dynamo names in its graph break
BLOCK_TRAMPOLINE = "deepcompile_block_trampoline"
BLOCK_TRAMPOLINE_REASON = ("the model's frame runs as Python around its blocks (compile.regions='blocks' compiles each "
                           "block on its own)")


def _reason(message: str) -> str:
    lines = [line.strip() for line in message.splitlines()]
    context = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Developer debug context:")), "")
    if BLOCK_TRAMPOLINE in context:  # the break every block makes by design, not dynamo's "disable()d function"
        return BLOCK_TRAMPOLINE_REASON
    head = lines[0][:300] if lines else ""
    return f"{head} ({context[:300]})" if head and context else head


def keep_getter_eager() -> None:
    """Never compile ZeRO-3's parameter getter, or what it calls, as frames of their own. Called from code dynamo
    runs eagerly, the getter would otherwise be compiled (where ``torch.compiler.is_compiling()`` makes it hand
    back the stand-in), and so would ZeRO-3's ``all_gather`` it calls to gather on access (dynamo breaks that
    code into partial graphs). Skipping is recursive for the getter's callees, and only for frames entered from
    eager code: dynamo still inlines the getter inside compiled frames. Likewise :func:`forward_gathering_returned`
    is never a frame of its own, but the module's own ``forward`` it calls is compiled as before, and the gather
    after it runs as Python. (``torch._dynamo.reset()`` forgets these; the runtime sets them again at every
    forward.)"""
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    effects.skip_frames([ZeROOrderedDict.__getitem__.__code__, gather_for_caller.__code__], with_callees=True)
    effects.skip_frames([forward_gathering_returned.__code__], with_callees=False)


# A module whose forward returns one of its parameters as it is (a gate, a scale) hands its caller that parameter
# holding its stand-in when dynamo compiled the module's frame on its own and runs the caller's as Python (a graph
# break in the loop over the blocks): the parameter leaves the compiled frame as the graph input it is, not as a
# graph output, so no graph op can gather it. While DeepCompile runs, such modules' ``forward`` is this function
# (bound to the module): called from Python, it runs as Python and gathers what the module's own forward, compiled
# as before, returned, as eager ZeRO-3 gathers a returned parameter for the caller; inside a compiled frame dynamo
# traces through it and it adds nothing to the graph.
def forward_gathering_returned(self, *args, **kwargs):
    output = type(self).forward(self, *args, **kwargs)
    if not torch.compiler.is_compiling():
        gather_for_caller(output)
    return output


def gather_for_caller(output) -> None:
    """Gather the ZeRO-3 parameters in a module's ``output`` for a caller run as Python, when a DeepCompile forward
    is running (also the block trampoline's, ``driver/regions.py``). Run as Python with everything it calls (never
    compiled: a ZeRO-3 gather is no graph)."""
    access = active()
    if access is not None:
        access.gather_returned(output)


def install_forwards_gathering_returned(root: torch.nn.Module) -> List[torch.nn.Module]:
    """Give the submodules of ``root`` that hold parameters :func:`forward_gathering_returned` as their ``forward``;
    returns them. Left out: ``torch.nn``'s own modules (dynamo never starts a frame in them, and none returns a
    parameter) and a module whose ``forward`` is already set on the instance (``regions: "blocks"``, accelerate's
    hooks). Bound as a method of the module, so a deep copy of the model calls its own copy."""
    modules = [m for m in root.modules() if m is not root and ModuleForward.own(m) is None
               and not type(m).__module__.startswith("torch.nn.") and any(True for _ in m.parameters())]
    for module in modules:
        ModuleForward.set(module, types.MethodType(forward_gathering_returned, module))
    return modules


def uninstall_forwards_gathering_returned(modules: List[torch.nn.Module]) -> None:
    for module in modules:
        ModuleForward.clear(module, lambda forward: getattr(forward, "__func__", None) is forward_gathering_returned)


class EagerAccess:
    """One per runtime: the parameters gathered for eager code in the current step, and their gradient hooks."""

    def __init__(self, table: ShardedParams, root: torch.nn.Module, reduce: Callable[[int, torch.Tensor], None],
                 on_live_bytes: Callable[[int], None], on_use: Callable[[Parameter], None]):
        self.table = table
        self.params = table.params
        # the parameter dicts ZeRO-3 gathers from on access while marked in forward (the module docstring)
        self._param_dicts = [m._parameters for m in root.modules() if hasattr(m._parameters, "_in_forward")]
        # a submodule that returns its own parameter to a caller run as Python gets it gathered (see below)
        self._gathering_returned = install_forwards_gathering_returned(root)
        self._reduce = reduce
        self._on_live_bytes = on_live_bytes
        self._on_use = on_use  # a gradient for the parameter may come from this use
        self.gathered: Dict[int, Parameter] = {}
        self._hooks = []
        self.reported: List[str] = []  # dynamo's reasons named in a warning so far, in order (engine_report)
        self.outside = False  # the forward running now is a submodule called outside any forward (runtime/z3.py)
        self._warned_reuse = False
        self._leaf_modules: Dict[int, List[Parameter]] = {}  # id(leaf module) -> its parameters, entered this step
        self._leaf_grads: Dict[int, torch.Tensor] = {}  # ds_id -> a leaf parameter's gradient, held until backward ends

    # ----- the contract ZeROOrderedDict.__getitem__ calls ------------------------------------------------
    def record_gathered_param(self, param: Parameter) -> None:
        if param.ds_id in self.gathered or self.params.get(param.ds_id) is not param:
            return
        self._record(param)
        self._enter_leaf(param)
        if self.outside:
            return  # a submodule called outside the forward runs uncompiled by design, as in eager ZeRO-3
        reasons = [r for r in _dynamo_reasons() if r not in self.reported]
        if reasons or not self.reported:
            self.reported.extend(reasons or ["(no reason recorded by dynamo)"])
            why = "; ".join(reasons) or "dynamo recorded no reason"
            log.warning("deepspeed-compile: parameter %s is read by code outside the compiled graphs (dynamo ran it "
                        "eagerly; dynamo's reason: %s). It is gathered on access and released after backward: "
                        "training stays correct, but this part of the model is not compiled.", self.name(param), why)

    def _record(self, param: Parameter) -> None:
        self.gathered[param.ds_id] = param
        self._on_use(param)
        self._on_live_bytes(param.data.numel() * param.data.element_size())

    # ----- ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules; MoE blocks) --------------------------
    # Eager ZeRO-3 gathers all of a leaf module's parameters when it is entered and reduces all of their gradients
    # (zeros for those that got none) when its backward is done, so that ranks routing tokens to different experts
    # still issue the same collectives. Code run eagerly here reads the parameters one by one instead: the first read
    # of a leaf module's parameter gathers the rest of the module's in one collective, and their gradients are held
    # and reduced together, in ds_id order, at the end of backward (zeros where none came). Graphs compiled for code
    # inside the module (an expert's own frame) read those parameters with no collective (``Z3Runtime.gather``). The
    # first read must be the same on every rank (a router, read before any routing): a leaf module whose first
    # parameter is read by a compiled graph, and later ones eagerly, is not covered.
    def _enter_leaf(self, param: Parameter) -> None:
        module = getattr(param, "ds_z3_leaf_module", None)
        if module is None or id(module) in self._leaf_modules:
            return
        params = sorted((p for p in module.parameters() if self.params.get(getattr(p, "ds_id", None)) is p),
                        key=lambda p: p.ds_id)
        self._leaf_modules[id(module)] = params
        missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if missing:
            missing[0].all_gather(param_list=missing)
        for p in missing:
            self._record(p)

    def holds(self, param: Parameter) -> bool:
        """``param`` is gathered for eager code now: a graph may read it as it is, with no collective."""
        return param.ds_id in self.gathered and param.ds_status == ZeroParamStatus.AVAILABLE

    def hold_leaf_grad(self, param: Parameter, grad: torch.Tensor) -> bool:
        """Keep a gradient of an entered leaf module's parameter (from eager code or a compiled graph run inside the
        module) for :meth:`reduce_leaf_grads`; False for any other parameter."""
        module = getattr(param, "ds_z3_leaf_module", None)
        if module is None or id(module) not in self._leaf_modules:
            return False
        held = self._leaf_grads.get(param.ds_id)
        self._leaf_grads[param.ds_id] = grad.detach().clone() if held is None else held + grad
        return True

    def reduce_leaf_grads(self, bucket: Callable[[int, torch.Tensor], None]) -> None:
        """Hand every entered leaf module's gradients to ``bucket``, in ds_id order on every rank (a zero gradient for
        a parameter whose expert got no tokens on this rank). Called at the end of backward, before the final flush."""
        modules = sorted(self._leaf_modules.values(), key=lambda params: params[0].ds_id if params else -1)
        self._leaf_modules.clear()
        for params in modules:
            for param in params:
                if not param.requires_grad:
                    continue
                grad = self._leaf_grads.pop(param.ds_id, None)
                if grad is None:
                    grad = torch.zeros(param.ds_shape, dtype=param.dtype, device=param.data.device)  # still gathered
                bucket(param.ds_id, grad)
        self._leaf_grads.clear()

    def gather(self, param) -> None:
        """Gather ``param`` (a ZeRO-3 parameter holding its stand-in) for code run outside the compiled graphs."""
        if isinstance(param, Parameter) and param.ds_id in self.params \
                and param.ds_status == ZeroParamStatus.NOT_AVAILABLE:
            param.all_gather()
            self.record_gathered_param(param)

    def gather_returned(self, output) -> None:
        """Gather the ZeRO-3 parameters in a compiled region's ``output`` (a module that returns its own parameter for
        its caller to use): dynamo returns such a graph input from the frame itself, holding its stand-in, and the
        caller's code runs eagerly. Eager ZeRO-3 gathers a returned parameter for its caller too."""
        for item in pytree.tree_leaves(output):
            self.gather(item)

    def note_reused_graph(self) -> None:
        if not self._warned_reuse:
            self._warned_reuse = True
            log.warning("deepspeed-compile: dynamo reuses a graph compiled for one module's parameters for another "
                        "instance of the same module (its top-level frame was skipped, or the model is compiled "
                        "per block); those calls run uncompiled with gathered parameters. Training stays correct.")

    def record_param_access(self, param: Parameter) -> None:
        return None  # an AVAILABLE parameter holds its real data: nothing to do

    def record_guard_suppressed_param(self, param: Parameter) -> None:
        return None  # guard evaluation reads metadata only; it must not gather

    def record_forward_graph(self) -> None:
        return None  # no per-graph bookkeeping: everything gathered here lives until backward ends

    def record_backward_start(self, forward_graph_id) -> None:
        return None

    def record_user_context_claim(self, param: Parameter) -> None:
        return None  # a GatheredParameters context re-gathers and partitions the parameter itself

    # ----- scope and release -----------------------------------------------------------------------------
    @contextmanager
    def activated(self):
        keep_getter_eager()
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def release(self) -> None:
        """Partition every parameter gathered for eager code (the step's backward is over, or never comes)."""
        self._leaf_modules.clear()
        self._leaf_grads.clear()
        if not self.gathered:
            return
        params = list(self.gathered.values())
        self.gathered.clear()
        freed = sum(p.data.numel() * p.data.element_size() for p in params
                    if p.ds_status == ZeroParamStatus.AVAILABLE)
        for param in params:
            if param.ds_status == ZeroParamStatus.AVAILABLE:
                param.partition()
        self._on_live_bytes(-freed)

    def name(self, param: Parameter) -> str:
        return self.table.name(param)

    def mark_in_forward(self, on: bool) -> None:
        """Mark every parameter dict as in a forward (ZeRO-3 then gathers a parameter read through it) or not."""
        for params in self._param_dicts:
            params._in_forward = on

    def uninstall_forwards(self) -> None:
        """The submodules' own ``forward`` back (:func:`install_forwards_gathering_returned`)."""
        uninstall_forwards_gathering_returned(self._gathering_returned)
        self._gathering_returned = []

    # ----- gradients of eagerly used parameters ----------------------------------------------------------
    def install_grad_hooks(self) -> None:
        keep_getter_eager()
        if self._hooks:
            return
        for param in self.params.values():
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def remove_grad_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _on_grad(self, param: Parameter) -> None:
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if param.ds_id not in self.gathered and not param.ds_persist:  # a persistent one holds its real values
            raise StandinReadError(
                f"deepspeed-compile: parameter {self.name(param)} was used outside the compiled graphs without "
                "being gathered (the code held the Parameter object instead of reading it through its module, "
                "e.g. module.weight); it computed with the parameter's stand-in, not its values. Read the "
                "parameter through its module, or keep that code inside the compiled model.")
        if not self.hold_leaf_grad(param, grad):
            self._reduce(param.ds_id, grad)
