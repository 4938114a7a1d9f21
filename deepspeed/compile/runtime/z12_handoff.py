# SPDX-License-Identifier: Apache-2.0
"""ZeRO-1/2's gradients, handed to ZeRO's optimizer from the compiled backward as autograd would hand them.

A compiled backward that returns its gradients holds every one of them until it returns: the whole model's gradients
at once, which ZeRO-2 exists to avoid. Here the backward graph calls ``reduce_grad`` as soon as a gradient exists and
returns None for it, and :class:`GradientHandOff` hands the gradient to ZeRO's optimizer exactly as autograd would
have: accumulated into ``param.grad`` (``AccumulateGrad``'s arithmetic), then the optimizer's own gradient hook body
(``process_gradients`` and its hook bookkeeping). A linear layer's weight gradient is computed by its reduce
(``reduce_grad_mm``) straight into the place ZeRO-2 would copy it to, its reduce bucket: ZeRO's copy then copies
nothing.

Gradients of a parameter from several sources (two compiled graphs across a graph break, or a graph and eager
code) are summed in ``param.grad`` first and handed over once, when the last source the forward announced has
delivered, as autograd sums them before its single ``AccumulateGrad``.
"""
import functools
from typing import Callable, Dict, List, Optional, Sequence, Set

import torch
from torch import Tensor
from torch.nn import Parameter

from . import registry
from .agreement import Peers
from .comm import CommLog


class TrainedParams:
    """ZeRO-1/2's trained parameters, by the ds_id the graph ops carry (``stage.py``, "one id vocabulary"): the
    optimizer's bit16 groups in order. Owns ``params``, each one's ``names`` and optimizer group, and the index from a
    parameter object to its ds_id."""

    def __init__(self, optimizer, module: torch.nn.Module):
        self.params: Dict[int, Parameter] = {}
        self.group_of: Dict[int, int] = {}  # ds_id -> index of the optimizer's bit16 group
        self._ds_id: Dict[int, int] = {}  # id(param) -> ds_id
        for group_index, group in enumerate(optimizer.bit16_groups):
            for param in group:
                if param.requires_grad:
                    ds_id = len(self.params)
                    self.params[ds_id] = param
                    self.group_of[ds_id] = group_index
                    self._ds_id[id(param)] = ds_id
        names = {id(p): name for name, p in module.named_parameters()}
        self.names = {ds_id: names.get(id(p), f"#{ds_id}") for ds_id, p in self.params.items()}

    def get(self, param) -> Optional[int]:
        """The ds_id of ``param`` if it is a trained parameter here, else None."""
        return self._ds_id.get(id(param))

    def ds_id_of(self, param: Tensor) -> int:
        """The ds_id of a trained parameter, from the tensor a graph op is given: the parameter object itself (the
        backward is handed the graph input, which is the parameter; both backends pass it through as it is)."""
        ds_id = self._ds_id.get(id(param))
        if ds_id is None:
            raise AssertionError("deepspeed-compile: a reduce op was given a tensor that is not a trained parameter of "
                                 f"this engine ({type(param).__name__}, shape {tuple(param.shape)})")
        return ds_id


class GradientHandOff:
    """Owns which gradients this step's forwards announced and which have come or been handed to ZeRO, and the
    gradient hooks it puts in place of ZeRO's. The reducer protocol every stage keeps (``z3_reduce.GradientReducer``
    is ZeRO-3's): ``note_source``, ``forget_sources``, ``reduce(ds_id, grad)``, ``end_of_backward``.
    ``running()`` says whether a forward runs or its backward is owed; ``peers`` agree before a backward's first
    gradient is accumulated or handed over (``agreement.py``)."""

    def __init__(self, optimizer, table: TrainedParams, stage: int, comm: CommLog, peers: Peers,
                 running: Callable[[], bool]):
        self.optimizer, self.table, self.stage, self.comm, self.peers = optimizer, table, stage, comm, peers
        self._running = running
        # DeepSpeed registers its gradient hooks only where it reduces or accumulates from them (ZeRO-2, overlap_comm,
        # contiguous_gradients, a separate accumulation dtype); without them it reduces at the boundary only
        self._zero_hooks = bool(optimizer._grad_acc_hooks)
        self._sources: Dict[int, int] = {}  # ds_id -> uses in this step's forwards still owing a gradient
        self._arrived: Set[int] = set()  # ds_ids with a gradient in param.grad not handed to ZeRO yet
        self._handed: Set[int] = set()  # ds_ids handed to ZeRO in this backward
        self._eager_incoming: Set[int] = set()  # ds_ids autograd is accumulating an eager gradient for
        self._eager_sources: Set[int] = set()  # ds_ids whose eager gradient a graph call announced (note_eager_uses)
        self._walked: Set = set()  # autograd nodes note_eager_uses walked in this forward
        self._own_hooks: List = []

    # ----- what the forward announces ---------------------------------------------------------------------
    def note_source(self, param: Parameter) -> None:
        """A compiled forward graph used the trained parameter ``param``: it owes one more gradient in backward."""
        ds_id = self.table.ds_id_of(param)
        self._sources[ds_id] = self._sources.get(ds_id, 0) + 1

    def forget_sources(self) -> None:
        """The announced gradients will not come (a forward with no backward), or the backward ended."""
        self._sources.clear()
        self._eager_sources.clear()

    def end_of_forward(self) -> None:
        self._walked.clear()  # the forward's autograd nodes are not held past it

    def note_eager_uses(self, inputs: Sequence) -> None:
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
                ds_id = self.table.get(leaf)
                if ds_id is not None and not compiled and ds_id not in self._eager_sources:
                    self._eager_sources.add(ds_id)
                    self._sources[ds_id] = self._sources.get(ds_id, 0) + 1

    # ----- gradients ------------------------------------------------------------------------------------
    def reduce_product(self, ds_id: int, mat1: Tensor, mat2: Tensor) -> None:
        """Parameter ``ds_id``'s gradient is ``mat1 @ mat2``: computed into ZeRO's bucket where it is handed over at
        once (ZeRO then copies it onto itself, which copies nothing), else into a tensor of its own, which
        ``param.grad`` can keep without the copy a graph's buffer needs. The same matmul kernel either way (``out=``
        changes where it writes, not its arithmetic)."""
        self._check_running()
        self.peers.before_collective()  # before the product is written into ZeRO's bucket (see reduce)
        counters = self.comm.counters.reduce
        counters.matmul_grads += 1
        slot = self._bucket_slot(ds_id, mat1, mat2)
        if slot is None:
            self.reduce(ds_id, torch.mm(mat1, mat2), owned=True)
        else:
            counters.grads_in_bucket += 1
            self.reduce(ds_id, torch.mm(mat1, mat2, out=slot))

    def _bucket_slot(self, ds_id: int, mat1: Tensor, mat2: Tensor) -> Optional[Tensor]:
        """Where ZeRO will copy parameter ``ds_id``'s gradient if it is handed over now (ZeRO-2, and ZeRO-1 at the
        accumulation boundary), as ZeRO's ``reduce_independent_p_g_buckets_and_remove_grads`` places it: the next
        elements of its communication dtype's bucket. None where that is not known here: the gradient is not handed
        over at once (more sources to come, one already in ``param.grad``), ZeRO does not copy it into its bucket
        (or copies another tensor: a separate accumulation dtype), or the bucket is full (ZeRO reduces it first) or
        of another dtype."""
        param, optimizer = self.table.params[ds_id], self.optimizer
        if (param.grad is not None or self._sources.get(ds_id, 0) > 1 or not self._copied_at_once(param)
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

    def _check_running(self) -> None:
        if not self._running():  # the backward that ended its step's forwards has run
            raise registry.backward_after_its_step()

    def reduce(self, ds_id: int, grad: Tensor, owned: bool = False) -> None:
        """A compiled backward produced parameter ``ds_id``'s gradient: accumulate it into ``param.grad`` as
        ``AccumulateGrad`` does (``+=`` on an existing gradient), and hand it to ZeRO once its last source came.
        ``owned``: ``grad`` is a tensor no graph holds, which ``param.grad`` may keep as it is."""
        self._check_running()
        # before a backward's first gradient is accumulated or handed to ZeRO (whose buckets reduce from there), the
        # ranks agree (runtime/agreement.py): a backward every rank stops leaves param.grad as it found it
        self.peers.before_collective()
        param = self.table.params[ds_id]
        if ds_id in self._handed:
            self._second_gradient(ds_id)
        remaining = self._sources.get(ds_id, 0) - 1
        self._sources[ds_id] = max(remaining, 0)
        if param.grad is not None:
            param.grad.add_(grad)
        elif owned or remaining <= 0 and grad.is_contiguous() and self._copied_at_once(param):
            param.grad = grad.detach()  # a tensor object of its own: ZeRO repoints its .data into the bucket
        else:
            # kept past this op: a copy. The graph's tensor may be a buffer autograd accumulates into (a gradient
            # passed through from the backward's input) or one inductor reuses for a later buffer.
            param.grad = grad.detach().clone(memory_format=torch.contiguous_format)
        self._arrived.add(ds_id)
        if remaining <= 0:
            self._hand_off(ds_id)

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
        ds_id = self.table.ds_id_of(param)
        if ds_id not in self._eager_incoming:
            return
        self._eager_incoming.discard(ds_id)
        self.comm.counters.reduce.eager_grads += 1
        if ds_id in self._eager_sources:  # the source a graph call announced for it has delivered
            self._eager_sources.discard(ds_id)
            self._sources[ds_id] = max(self._sources.get(ds_id, 0) - 1, 0)
        if ds_id in self._handed:
            self._second_gradient(ds_id)
        self._arrived.add(ds_id)
        if self._sources.get(ds_id, 0) == 0:  # no compiled graph owes it a gradient: hand it over now
            self._hand_off(ds_id)

    def _second_gradient(self, ds_id: int) -> None:
        if self.stage == 2:
            raise RuntimeError(
                f"deepspeed-compile: parameter {self.table.names[ds_id]!r} got a gradient from eager code after ZeRO-2 "
                "had reduced its gradient from the compiled graphs in this backward (a weight used both inside and "
                "outside the compiled graphs, its eager use earlier in forward and not on the way to a compiled "
                "graph's input). Compile the code that uses it, or keep its uses on one side of the graph break")
        self._handed.discard(ds_id)  # ZeRO-1 reduces from param.grad at the boundary: accumulating again is right

    def _hand_off(self, ds_id: int) -> None:
        """The body of ZeRO-1/2's own gradient hook for this parameter (``create_gradient_handling_hooks``)."""
        self._arrived.discard(ds_id)
        self._handed.add(ds_id)
        self.comm.counters.reduce.reduces += 1
        if not self._zero_hooks:
            return
        optimizer = self.optimizer
        optimizer.reenter_backward_if_needed()
        optimizer.process_gradients(self.table.params[ds_id], self.table.group_of[ds_id])
        # ZeRO's hook queues the engine's post-backward callback (torch-style loss.backward() ends the step there);
        # the count of hooks to expect only matters where autograd cannot queue it. ZeRO counts the parameters
        # autograd will reach, which is not computable inside a compiled op (autograd is below it): every trained
        # parameter is an upper bound, so the callback never runs early.
        optimizer.update_hook_state_and_maybe_run_epilogue(len(self.table.params))

    def end_of_backward(self) -> None:
        """A graph that owed a gradient produced none: hand over what came; the backward's bookkeeping cleared."""
        for ds_id in sorted(self._arrived):
            self._hand_off(ds_id)
        self.forget_sources()
        self._handed.clear()

    # ----- ZeRO's gradient hooks, replaced ------------------------------------------------------------------
    def take_over_grad_hooks(self) -> None:
        """ZeRO's gradient hooks out, ours in: a gradient autograd accumulates from eager code reaches ZeRO through
        this hand-off, which knows whether the compiled graphs still owe that parameter a gradient."""
        for hook in self.optimizer._grad_acc_hooks:
            hook.remove()
        self.optimizer._grad_acc_hooks.clear()
        self._own_hooks = []
        for ds_id, param in self.table.params.items():
            self._own_hooks.append(param.register_hook(functools.partial(self._on_incoming, ds_id)))
            self._own_hooks.append(param.register_post_accumulate_grad_hook(self._on_accumulated))

    def _on_incoming(self, ds_id: int, grad: Optional[Tensor]) -> None:
        """Autograd is about to accumulate into parameter ``ds_id``: ``grad`` is None when it comes only from the
        compiled graphs (their backward returns None for it), else the gradient of its eager uses."""
        if grad is not None:
            self.peers.before_collective()  # before autograd accumulates it (see reduce)
            self._eager_incoming.add(ds_id)

    def give_back_grad_hooks(self) -> None:
        """ZeRO's own gradient hooks back (the engine returns to eager ZeRO-1/2)."""
        for hook in self._own_hooks:
            hook.remove()
        self._own_hooks = []
        if self._zero_hooks and not self.optimizer._grad_acc_hooks:
            self.optimizer.create_gradient_handling_hooks()
