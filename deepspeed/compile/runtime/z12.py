# SPDX-License-Identifier: Apache-2.0
"""The per-engine runtime of DeepCompile for ZeRO stages 1 and 2: gradients handed to ZeRO from the compiled backward.

Parameters are replicated in these stages, so the graphs gather nothing. What DeepCompile changes is where each
gradient goes. A compiled backward that returns its gradients holds every one of them until it returns: the whole
model's gradients at once, which ZeRO-2 exists to avoid. Here the backward graph calls ``reduce_grad`` as soon as a
gradient exists and returns None for it, and this runtime hands the gradient to ZeRO's optimizer exactly as autograd
would have: accumulated into ``param.grad`` (``AccumulateGrad``'s arithmetic), then the optimizer's own gradient
hook body (``process_gradients`` and its hook bookkeeping). DeepSpeed's optimizer then does what it does in eager
ZeRO-1/2, with every option it has: ZeRO-2 copies the gradient into its reduce bucket and reduces full buckets
while backward goes on, dropping the full-size gradient; ZeRO-1 keeps it until the accumulation boundary. One
thing is changed: eager ZeRO-2 waits for each full bucket's collective inside backward (on CPU always, elsewhere
without ``overlap_comm``), and here it is left in flight until the next full bucket or the end of backward
(``z12_reduce.py``). At the end of backward the runtime runs the reduction the engine skips while DeepCompile is
active (``engine.allreduce_gradients``). Same buckets, same collectives, same casts: the arithmetic is eager
ZeRO-1/2's, bit for bit. A linear layer's weight gradient is computed by its reduce (``reduce_grad_mm``) straight into
the place ZeRO-2 would copy it to, its reduce bucket: ZeRO's copy then copies nothing.

Gradients of a parameter from several sources (two compiled graphs across a graph break, or a graph and eager
code) are summed in ``param.grad`` first and handed over once, when the last source the forward announced has
delivered, as autograd sums them before its single ``AccumulateGrad``.
"""
import datetime
import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set

import torch
from torch import Tensor
from torch.nn import Parameter

from . import registry
from .. import compat
from .agreement import Peers
from .ops import gradient_wanted
from .host_comm import DEFAULT_DIR, REDUCE_SLOT_BYTES, open_host_comm
from .z12_reduce import BucketFlush


@dataclass
class Z12Counters:
    reduces: int = 0  # gradients handed to ZeRO from the graphs or eager code
    eager_grads: int = 0  # of the gradients that came, those autograd accumulated from eager code (frames run as Python)
    reduce_bytes: int = 0  # bytes ZeRO's buckets reduced, in each gradient's communication dtype
    reduce_collectives: int = 0  # ZeRO bucket reductions
    reduce_wait_seconds: float = 0.0  # time inside ZeRO's bucket reductions (copies, and waits for collectives)
    reduces_started_ahead: int = 0  # bucket reductions left in flight while backward went on (z12_reduce.py)
    matmul_grads: int = 0  # gradients a reduce computed itself, fused with their matmul (reduce_grad_mm)
    grads_in_bucket: int = 0  # of those, computed straight into ZeRO-2's reduce bucket (no copy into it)


class Z12Runtime(Peers):

    def __init__(self, engine, *, stage: int, timeout_s: float = 0.0, host_comm: str = "auto",
                 host_comm_dir: str = DEFAULT_DIR):
        compat.require_attributes(engine.optimizer, compat.ZERO12_OPTIMIZER_STATE, "DeepSpeedZeroOptimizer")
        self.engine = engine
        self.optimizer = engine.optimizer
        self.group = self.optimizer.dp_process_group
        self.agree_timeout = datetime.timedelta(seconds=timeout_s) if timeout_s > 0 else None
        self.stage = stage
        # every trained parameter ZeRO's optimizer holds, keyed by a small integer the graph ops carry
        self.params: Dict[int, Parameter] = {}
        self._group: Dict[int, int] = {}  # key -> index of the optimizer's bit16 group
        self._key: Dict[int, int] = {}  # id(param) -> key
        for group_index, group in enumerate(self.optimizer.bit16_groups):
            for param in group:
                if param.requires_grad:
                    key = len(self.params)
                    self.params[key] = param
                    self._group[key] = group_index
                    self._key[id(param)] = key
        names = {id(p): name for name, p in engine.module.named_parameters()}
        self._names = {key: names.get(id(p), f"#{key}") for key, p in self.params.items()}
        # DeepSpeed registers its gradient hooks only where it reduces or accumulates from them (ZeRO-2, overlap_comm,
        # contiguous_gradients, a separate accumulation dtype); without them it reduces at the boundary only
        self._zero_hooks = bool(self.optimizer._grad_acc_hooks)
        self.counters = Z12Counters()
        self.input_cast_hook = None  # fp16 auto_cast: the engine's input cast, as a forward pre-hook
        self._grad_sources: Dict[int, int] = {}  # key -> uses in this step's forwards still owing a gradient
        self._arrived: Set[int] = set()  # keys with a gradient in param.grad not handed to ZeRO yet
        self._handed: Set[int] = set()  # keys handed to ZeRO in this backward
        self._eager_incoming: Set[int] = set()  # keys autograd is accumulating an eager gradient for
        self._eager_sources: Set[int] = set()  # keys whose eager gradient a graph call announced (_note_eager_uses)
        self._walked: Set = set()  # autograd nodes _note_eager_uses walked in this forward
        self._backward_pending = False
        self._forward_running = False  # a backward inside a forward (torch.autograd.grad in the model) belongs to it
        self._own_hooks: List = []
        self._take_over_grad_hooks()
        # ZeRO's bucket reductions, counted, and at ZeRO-2 left in flight while backward goes on
        self.flush = BucketFlush(self.optimizer, lambda: self.counters, timeout_s)
        # the bucket all-reduces the flush starts itself (ZeRO-2's) through shared memory where every rank is on this
        # host (compile.host_comm); ZeRO's own paths (ZeRO-1's among them) go through the process group
        numel = sum(p.numel() for group in self.optimizer.bit16_groups for p in group)
        self.host, self.host_comm_reason = open_host_comm(
            host_comm, self.optimizer.dp_process_group, torch.device(engine.device), gather_slot_bytes=0,
            reduce_slot_bytes=min(REDUCE_SLOT_BYTES, numel * 4), directory=host_comm_dir) \
            if self.flush.overlapped else (None, "ZeRO's own reductions (not overlapped) go through the process group")
        self.host_comm = "gloo" if self.host is None else "shm"
        self.flush.host = None if self.host is None else self.host.reduce
        self.optimizer.reduce_ipg_grads = self.flush.reduce_ipg_grads
        self.optimizer.setup_buckets = self.flush.setup_buckets
        self.id = registry.register(self)

    # ----- what the compiler asks -------------------------------------------------------------------------
    def param_ds_ids(self, inputs) -> List[Optional[int]]:
        """Parameters gathered by the graphs: none in these stages."""
        return [None] * len(inputs)

    def grad_keys(self, inputs) -> List[Optional[int]]:
        """For every graph input, the key of the trained parameter it is (its gradient is reduced in the graph)."""
        return [self._key.get(id(t)) if isinstance(t, Parameter) else None for t in inputs]

    gather_bucket_numel = 0  # nothing to coalesce

    def prefetch_bucket_bytes(self) -> int:
        return 0

    def note_graph_call(self, args: Sequence, grad_inputs: Sequence[int]) -> None:
        """A compiled forward graph ran with grad enabled: each trained parameter among its inputs owes one more
        gradient in the coming backward."""
        if not torch.is_grad_enabled():
            return
        for i in grad_inputs:
            key = self._key[id(args[i])]
            self._grad_sources[key] = self._grad_sources.get(key, 0) + 1
        self._note_eager_uses(args)

    def _note_eager_uses(self, inputs: Sequence) -> None:
        """Trained parameters that eager code used earlier in this forward, in computing a graph input (an embedding
        in a frame dynamo skipped, its weight tied to a compiled head): backward runs in reverse, so autograd
        accumulates their eager gradient after the graph's backward has produced its own. Each owes one gradient more,
        and is handed to ZeRO once both have come, summed as autograd sums them. Found by walking the inputs' autograd
        graph back to the parameters' ``AccumulateGrad`` nodes, except through a compiled graph's backward node (its
        parameters were counted by its own call); each node once per forward, each parameter once per backward (all
        its eager uses reach its one ``AccumulateGrad`` together). The parameters among the inputs are leaves, with no
        ``grad_fn``: a fully compiled model's call walks nothing."""
        stack = [t.grad_fn for t in inputs if isinstance(t, Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in self._walked:
                continue
            self._walked.add(node)
            compiled = type(node).__name__ == "CompiledFunctionBackward"
            for child, _ in node.next_functions:
                if child is None:
                    continue
                leaf = getattr(child, "variable", None)  # an AccumulateGrad node's parameter
                if leaf is None:
                    stack.append(child)
                    continue
                key = self._key.get(id(leaf))
                if key is not None and not compiled and key not in self._eager_sources:
                    self._eager_sources.add(key)
                    self._grad_sources[key] = self._grad_sources.get(key, 0) + 1

    # ----- gradients ------------------------------------------------------------------------------------
    def reduce_op(self, grad: Tensor, traced_key: int, param: Optional[Tensor]) -> None:
        """The ``reduce_grad`` op: the gradient of ``param``, the parameter the backward was handed (the graph may
        serve another module of the code it was traced on, whose parameter ``traced_key`` names)."""
        key = self.key_of(param)
        if gradient_wanted(self.params[key]):  # else torch.autograd.grad of other inputs: dropped, as autograd drops it
            self.reduce(key, grad)

    def reduce_product_op(self, mat1: Tensor, mat2: Tensor, traced_key: int, param: Optional[Tensor]) -> None:
        """The ``reduce_grad_mm`` op: ``param``'s gradient is ``mat1 @ mat2``. Computed into ZeRO's bucket where it
        is handed over at once (ZeRO then copies it onto itself, which copies nothing), else into a tensor of its
        own, which ``param.grad`` can keep without the copy a graph's buffer needs; not computed where autograd does
        not want it. The same matmul kernel either way (``out=`` changes where it writes, not its arithmetic)."""
        key = self.key_of(param)
        if not gradient_wanted(self.params[key]):
            return
        self._check_backward_running()
        self.before_collective()  # before the product is written into ZeRO's bucket (see reduce)
        self.counters.matmul_grads += 1
        slot = self._bucket_slot(key, mat1, mat2)
        if slot is None:
            self.reduce(key, torch.mm(mat1, mat2), owned=True)
        else:
            self.counters.grads_in_bucket += 1
            self.reduce(key, torch.mm(mat1, mat2, out=slot))

    def _bucket_slot(self, key: int, mat1: Tensor, mat2: Tensor) -> Optional[Tensor]:
        """Where ZeRO will copy parameter ``key``'s gradient if it is handed over now (ZeRO-2, and ZeRO-1 at the
        accumulation boundary), as ZeRO's ``reduce_independent_p_g_buckets_and_remove_grads`` places it: the next
        elements of its communication dtype's bucket. None where that is not known here: the gradient is not handed
        over at once (more sources to come, one already in ``param.grad``), ZeRO does not copy it into its bucket
        (or copies another tensor: a separate accumulation dtype), or the bucket is full (ZeRO reduces it first) or
        of another dtype."""
        param, optimizer = self.params[key], self.optimizer
        if (param.grad is not None or self._grad_sources.get(key, 0) > 1 or not self._copied_at_once(param)
                or optimizer.zenflow or optimizer.use_grad_accum_attribute or optimizer._coalesce_grad_reduction
                or not getattr(param, "ds_grad_is_ready", True)):
            return None
        optimizer.setup_buckets()  # what the hand-off does first (once a backward): the bucket exists
        bucket = optimizer.ipg_buckets[optimizer.get_param_comm_dtype(param)]
        buffer = bucket.buffer[bucket.index]
        if (bucket.elements + param.numel() > optimizer.reduce_bucket_size or buffer.dtype != mat1.dtype
                or mat2.dtype != mat1.dtype or buffer.device != mat1.device):
            return None
        return buffer.narrow(0, bucket.elements, param.numel()).view(param.shape)

    def key_of(self, param: Tensor) -> int:
        """The key of a trained parameter, from the tensor a graph op is given: the parameter object itself (the
        backward is handed the graph input, which is the parameter; both backends pass it through as it is)."""
        key = self._key.get(id(param))
        if key is None:
            raise AssertionError("deepspeed-compile: a reduce op was given a tensor that is not a trained parameter of "
                                 f"this engine ({type(param).__name__}, shape {tuple(param.shape)})")
        return key

    def _check_backward_running(self) -> None:
        if not (self._backward_pending or self._forward_running):  # the backward that ended its step's forwards has run
            raise registry.backward_after_its_step()

    def reduce(self, key: int, grad: Tensor, owned: bool = False) -> None:
        """A compiled backward produced parameter ``key``'s gradient: accumulate it into ``param.grad`` as
        ``AccumulateGrad`` does (``+=`` on an existing gradient), and hand it to ZeRO once its last source came.
        ``owned``: ``grad`` is a tensor no graph holds, which ``param.grad`` may keep as it is."""
        self._check_backward_running()
        # before a backward's first gradient is accumulated or handed to ZeRO (whose buckets reduce from there), the
        # ranks agree (runtime/agreement.py): a backward every rank stops leaves param.grad as it found it
        self.before_collective()
        param = self.params[key]
        if key in self._handed:
            self._second_gradient(key)
        remaining = self._grad_sources.get(key, 0) - 1
        self._grad_sources[key] = max(remaining, 0)
        if param.grad is not None:
            param.grad.add_(grad)
        elif owned or remaining <= 0 and grad.is_contiguous() and self._copied_at_once(param):
            param.grad = grad.detach()  # a tensor object of its own: ZeRO repoints its .data into the bucket
        else:
            # kept past this op: a copy. The graph's tensor may be a buffer autograd accumulates into (a gradient
            # passed through from the backward's input) or one inductor reuses for a later buffer.
            param.grad = grad.detach().clone(memory_format=torch.contiguous_format)
        self._arrived.add(key)
        if remaining <= 0:
            self._hand_off(key)

    def _copied_at_once(self, param: Parameter) -> bool:
        """ZeRO copies a gradient into its contiguous reduce bucket inside the hand-off and keeps no reference to the
        tensor it was given: ZeRO-2 always, ZeRO-1 with ``overlap_comm`` at the accumulation boundary (ZeRO-1 keeps
        it otherwise, to reduce at the end of the boundary's backward), as ``process_gradients`` and
        ``reduce_ready_partitions_and_remove_grads`` decide. Not a gradient wider than the bucket (kept, to reduce
        later)."""
        optimizer = self.optimizer
        return (self._zero_hooks and optimizer.contiguous_gradients and param.numel() <= optimizer.reduce_bucket_size
                and (self.stage == 2 or optimizer.overlap_comm and optimizer.is_gradient_accumulation_boundary()))

    def _on_accumulated(self, param: Parameter) -> None:
        """Autograd accumulated a gradient from eager code (a frame dynamo ran uncompiled) into ``param.grad``. (It
        calls this hook for the compiled graphs' None gradients too: only a gradient announced by the pre-hook
        counts.)"""
        key = self._key[id(param)]
        if key not in self._eager_incoming:
            return
        self._eager_incoming.discard(key)
        self.counters.eager_grads += 1
        if key in self._eager_sources:  # the source a graph call announced for it has delivered
            self._eager_sources.discard(key)
            self._grad_sources[key] = max(self._grad_sources.get(key, 0) - 1, 0)
        if key in self._handed:
            self._second_gradient(key)
        self._arrived.add(key)
        if self._grad_sources.get(key, 0) == 0:  # no compiled graph owes it a gradient: hand it over now
            self._hand_off(key)

    def _second_gradient(self, key: int) -> None:
        if self.stage == 2:
            raise RuntimeError(
                f"deepspeed-compile: parameter {self._names[key]!r} got a gradient from eager code after ZeRO-2 had "
                "reduced its gradient from the compiled graphs in this backward (a weight used both inside and "
                "outside the compiled graphs, its eager use earlier in forward and not on the way to a compiled "
                "graph's input). Compile the code that uses it, or keep its uses on one side of the graph break")
        self._handed.discard(key)  # ZeRO-1 reduces from param.grad at the boundary: accumulating again is right

    def _hand_off(self, key: int) -> None:
        """The body of ZeRO-1/2's own gradient hook for this parameter (``create_gradient_handling_hooks``)."""
        self._arrived.discard(key)
        self._handed.add(key)
        self.counters.reduces += 1
        if not self._zero_hooks:
            return
        optimizer = self.optimizer
        optimizer.reenter_backward_if_needed()
        optimizer.process_gradients(self.params[key], self._group[key])
        # ZeRO's hook queues the engine's post-backward callback (torch-style loss.backward() ends the step there);
        # the count of hooks to expect only matters where autograd cannot queue it. ZeRO counts the parameters
        # autograd will reach, which is not computable inside a compiled op (autograd is below it): every trained
        # parameter is an upper bound, so the callback never runs early.
        optimizer.update_hook_state_and_maybe_run_epilogue(len(self.params))

    # ----- DeepSpeed's hooks ---------------------------------------------------------------------------------
    def _take_over_grad_hooks(self) -> None:
        """ZeRO's gradient hooks out, ours in: a gradient autograd accumulates from eager code reaches ZeRO through
        this runtime, which knows whether the compiled graphs still owe that parameter a gradient."""
        for hook in self.optimizer._grad_acc_hooks:
            hook.remove()
        self.optimizer._grad_acc_hooks.clear()
        self._own_hooks = []
        for key, param in self.params.items():
            self._own_hooks.append(param.register_hook(functools.partial(self._on_incoming, key)))
            self._own_hooks.append(param.register_post_accumulate_grad_hook(self._on_accumulated))

    def _on_incoming(self, key: int, grad: Optional[Tensor]) -> None:
        """Autograd is about to accumulate into parameter ``key``: ``grad`` is None when it comes only from the
        compiled graphs (their backward returns None for it), else the gradient of its eager uses."""
        if grad is not None:
            self.before_collective()  # before autograd accumulates it (see reduce)
            self._eager_incoming.add(key)

    def detach(self) -> None:
        """Give ZeRO its own gradient hooks and reductions back (the engine returns to eager ZeRO-1/2)."""
        self.flush.finish()
        for hook in self._own_hooks:
            hook.remove()
        self._own_hooks = []
        self.optimizer.__dict__.pop("reduce_ipg_grads", None)
        self.optimizer.__dict__.pop("setup_buckets", None)
        if self._zero_hooks and not self.optimizer._grad_acc_hooks:
            self.optimizer.create_gradient_handling_hooks()
        if self.input_cast_hook is not None:
            self.input_cast_hook.remove()
            self.input_cast_hook = None

    # ----- engine hooks ----------------------------------------------------------------------------------
    @property
    def forward_running(self) -> bool:
        return self._forward_running

    @contextmanager
    def forward_context(self):
        """One forward of the engine; with grad enabled, a backward will end the step's gradient bookkeeping."""
        if not self._backward_pending:
            self._grad_sources.clear()
            self._eager_sources.clear()
        self._forward_running = True
        try:
            yield
        finally:
            self._forward_running = False
            self._walked.clear()  # the forward's autograd nodes are not held past it
        self._backward_pending = self._backward_pending or torch.is_grad_enabled()
        if not self._backward_pending:
            self._grad_sources.clear()
            self._eager_sources.clear()

    def reset_counters(self) -> None:
        self.counters = Z12Counters()

    def backward_prologue(self, is_boundary: bool) -> None:
        return None  # the engine tells ZeRO's optimizer about the boundary itself

    def backward_epilogue(self) -> None:
        if not self._backward_pending:
            return
        self._backward_pending = False
        for key in sorted(self._arrived):  # a graph that owed a gradient produced none: hand over what came
            self._hand_off(key)
        self._grad_sources.clear()
        self._eager_sources.clear()
        self._handed.clear()
        self._reduce_as_the_engine()
        self.flush.finish()  # where the engine reduced nothing at the end, what started in backward still lands

    def _reduce_as_the_engine(self) -> None:
        """``engine.allreduce_gradients`` (which the engine skips while DeepCompile is active), for ZeRO-1/2."""
        engine, optimizer = self.engine, self.optimizer
        if not engine.enable_backward_allreduce or engine.inside_no_sync_ctxt:
            return
        self.before_collective()
        boundary = engine.is_gradient_accumulation_boundary()
        optimizer.set_gradient_accumulation_boundary(boundary)
        if engine.zero_optimization_partition_gradients():
            optimizer.overlapping_partition_gradients_reduce_epilogue()
        elif boundary:
            optimizer.reduce_gradients(pipeline_parallel=engine.pipeline_parallelism)

