# SPDX-License-Identifier: Apache-2.0
"""Keeping the ranks on one path when one of them cannot run the compiled graph its peers run.

A rank whose compile fails, or whose frame dynamo sends to eager past ``torch._dynamo.config.recompile_limit``, would
otherwise go on alone: its collectives (eager ZeRO's, or none) then meet the peers' compiled ones, and the job hangs
or exchanges the wrong bytes. So every compiled graph's first collective is preceded by one small all-reduce,
:func:`agree`, in which each rank says that it runs its graph; a rank that cannot run the graph makes the same
all-reduce in its place, at the point its compile failed or the limit was reached, with a code that says why. Every
rank thus learns, at the same point of the same step, which ranks stopped and why (a second collective carries the
causes, only then), and all stop that step together (:class:`StepAbandoned`) and go on as eager ZeRO. Where every
rank reached the recompile limit at that frame they all run it uncompiled, as dynamo would, and the step goes on.

The agreement waits for a graph's first collective, not its start: ranks may run different numbers of graphs that
issue none (a graph inside a leaf module reads the parameters eager code gathered, and a router may send this rank's
tokens to experts it does not send another's to), while the graphs that issue collectives run alike on every rank,
or their collectives would not pair. A graph run marks an agreement due (:meth:`Peers.graph_started`), at its start
and, for its backward, when the first gradient reaches its outputs; the runtime's next collective makes it
(:meth:`Peers.before_collective`). A ZeRO-3 forward graph thus agrees once and its backward once, whole model or block
by block, and a backward compiled lazily, at its first run, fails on one rank as a forward does.

At ZeRO-1/2 the graphs issue no collective of their own; their backward hands gradients to ZeRO, which reduces
them, so the agreement comes before a backward's first gradient is accumulated or handed over
(``GradientHandOff.reduce``) or ZeRO-1's reduction at the end of backward: a backward every rank stops leaves
``param.grad`` as it found it. A graph under ``no_grad`` there hands nothing and agrees on nothing (an evaluation may
run on one rank alone); a frame past the recompile limit runs as Python and hands its gradients over the same way, so
the ranks' collectives stay the same and nothing is agreed.

The all-reduce goes through the runtime's transport: a few bytes through shared memory, or one small gloo all-reduce
through the process group (its cost: docs/benchmarks.md, "Shared memory against the process group"). It applies where
the process group is gloo (the CPU path); on NCCL it would make the host wait for the device at every graph.
``compile.agree_on_failures: false`` turns it off: a failure is then only posted through shared memory
(``HostComm.post_failure``), and through the process group the ranks may go on different paths.
"""
import datetime
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .comm import timeout_named
from .host_comm import HostComm, start_sum
from ..native.gather import wait_for

RUN, FAILED, LIMIT = 0, 1, 2  # what a rank does at a compiled graph's start
_WHAT = {FAILED: "failed", LIMIT: "reached the recompile limit"}
IDENT = -2  # the agreement's id in a shared-memory slot: no parameter's ds_id


class StepAbandoned(RuntimeError):
    """Every rank stops this step: one or more could not run the compiled graph the others would have."""


@dataclass
class Outcome:
    codes: List[int]  # each rank's code
    causes: List[str]  # each rank's cause ("" where it ran)

    def all(self, code: int) -> bool:
        return all(c == code for c in self.codes)

    def describe(self) -> str:
        """``rank 1 failed: <cause>``, a clause for each rank that did not run the graph."""
        return "; ".join(f"rank {rank} {_WHAT.get(code, 'stopped')}: {self.causes[rank]}"
                         for rank, code in enumerate(self.codes) if code != RUN)


def applies(group) -> bool:
    """Whether the ranks of ``group`` agree at every graph's start: more than one rank, on gloo."""
    return dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo"


def agree(group, host: Optional[HostComm], code: int, cause: str = "",
          timeout: Optional[datetime.timedelta] = None) -> Optional[Outcome]:
    """Every rank of ``group`` says what it does at this graph's start (``code``; ``cause`` where it does not run):
    None where every rank runs the graph, else what each rank does and why."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    codes = torch.zeros(1, world_size)
    codes[0, rank] = code
    work = start_sum(host.reduce, codes, None, ident=IDENT) if host is not None else \
        dist.all_reduce(codes, group=group, async_op=True)
    with timeout_named(timeout, lambda: "the ranks' agreement at a compiled graph's start"):
        wait_for(work, timeout)
    said = [int(c) for c in codes[0].tolist()]
    if not any(said):
        return None
    causes: List[str] = [""] * world_size
    dist.all_gather_object(causes, cause, group=group)
    return Outcome(said, causes)


class Peers:
    """What a runtime (any stage's, ``stage.py``) does with its peers on the engine's behalf: its part that owns the
    agreement's state. ``group`` is the data-parallel process group, ``host`` the runtime's :class:`HostComm` (None
    where its collectives go through the process group), ``timeout`` the wait's limit (None: the transport's own)."""

    def __init__(self, group, host: Optional[HostComm], timeout: Optional[datetime.timedelta]):
        self.group, self.host, self.timeout = group, host, timeout
        self.agreements = 0  # agreements made so far (a float32 a rank each, all-reduced)
        self.agree_on_failures = True  # compile.agree_on_failures
        self.agreement_due = False  # a graph ran since the last agreement: the next collective agrees first
        self.on_stopped: Optional[Callable[[Outcome], None]] = None  # raises: a peer could not run its graph

    def agrees_now(self) -> bool:
        """Whether the ranks agree before each graph's first collective: with ``compile.agree_on_failures``, on gloo
        with more than one rank."""
        return self.agree_on_failures and applies(self.group)

    def graph_started(self) -> None:
        """A compiled graph starts (its forward, or its backward): its first collective agrees first, if the
        ranks agree now."""
        if self.agrees_now():
            self.agreement_due = True

    def before_collective(self) -> None:
        """The runtime is about to start a collective: where a graph started since the last agreement, every rank
        agrees first, and where one could not run its graph, :attr:`on_stopped` raises."""
        if self.agreement_due:
            outcome = self.agree(RUN)
            if outcome is not None and self.on_stopped is not None:
                self.on_stopped(outcome)

    def agree(self, code: int, cause: str = "") -> Optional[Outcome]:
        """:func:`agree` on this runtime's ranks and transport (the agreement due, if any, is this one)."""
        self.agreement_due = False
        self.agreements += 1
        return agree(self.group, self.host, code, cause, self.timeout)

    def post_failure(self, message: str) -> None:
        """This rank cannot go on with its graphs (``message`` says why): tell the peers, whose next wait on shared
        memory raises naming this rank and the cause (:meth:`HostComm.post_failure`)."""
        if self.host is not None:
            self.host.post_failure(message)
