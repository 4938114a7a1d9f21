# SPDX-License-Identifier: Apache-2.0
"""What gloo's collectives cost on this machine for a gradient bucket: its reduce-scatter against an all-reduce of the
same buffer (what the ZeRO-3 runtime issues instead on gloo, ``runtime/z3_reduce.py``), and an all-gather of the
same output size. And for a run of parameters gathered in one collective (``runtime/z3_runs.py``), of the same
total gathered size split into ``--members`` parameters: received as rows and each parameter copied out of them
(``gather_rows``, what the runtime issues), against received straight into each parameter's own buffer
(``gather_per_param``, gloo's ``all_gather_single_coalesced``, which saves the copies but is not safe, below).

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py [--mib 4,24]

For each size (MiB of fp32 sent by each rank to the reduce), rank 0 prints the median over ``--repeats`` timed calls
(after one untimed) of each collective, every call started after a barrier so both ranks start it together. Beside
gloo's, the same three collectives through shared memory as the runtime runs them where every rank is on this host
(``compile.host_comm``, ``runtime/host_comm.py``): ``shm_reduce_scatter`` (this rank's row of the bucket summed),
``shm_all_reduce`` (all of it, ZeRO-2's form) and ``shm_all_gather``; and ``copy``, one copy of the gathered size.

Last, what a compiled forward graph's start costs, the ranks' agreement (``runtime/agreement.py``): the median of
``--agree-calls`` calls in a row, through the process group and through shared memory.

``--race SECONDS`` instead runs one form of a run's gather (``--race-form``) for that long the way the runtime runs it:
started asynchronously, an all-reduce in flight beside it (a gradient bucket), the host allocating meanwhile, each
result checked. gloo's coalesced form kills a rank within seconds on 2 CPU ranks: its heap is corrupted (glibc aborts,
"malloc(): unaligned tcache chunk detected", or a segfault; in the test suite it crashed two of four CI runs, in
tests that had passed many times). The rows form runs to the end, and each rank prints its iterations.
``MALLOC_CHECK_=3`` (glibc's heap checks) makes the crash come sooner and surer:

    MALLOC_CHECK_=3 python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py \
        --race 60 --race-form rows          # then --race-form per_param
"""
import argparse
import random
import statistics
import time
from typing import List

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()
from deepspeed.compile.runtime.agreement import RUN, agree  # noqa: E402
from deepspeed.compile.runtime.host_comm import (REDUCE_SLOT_BYTES, Channel, HostComm, start_gather,  # noqa: E402
                                                 start_sum)


def _gather_rows(shards: List[torch.Tensor], world: int) -> List[torch.Tensor]:
    send = torch.cat(shards)
    rows = torch.empty(world, send.numel())
    dist.all_gather_single(rows.view(-1), send)
    columns = torch.tensor([0] + [s.numel() for s in shards]).cumsum(0).tolist()
    return [rows[:, a:b].reshape(-1) for a, b in zip(columns, columns[1:])]


def _gather_per_param(shards: List[torch.Tensor], world: int) -> List[torch.Tensor]:
    outputs = [torch.empty(s.numel() * world) for s in shards]
    dist.group.WORLD.all_gather_single_coalesced(outputs, shards).wait()
    return outputs


def _shm_all_gather(channel: Channel, part: torch.Tensor) -> None:
    assert start_gather(channel, [part], torch.float32)[1].wait()


def _race(seconds: float, form: str, world: int) -> None:
    """Runs of 1-6 parameters (sizes from a seed both ranks share) gathered in ``form`` for ``seconds``, each with an
    all-reduce in flight beside it and host allocations meanwhile; every gathered value checked."""
    rank = dist.get_rank()
    rng = random.Random(0)
    iterations, start = 0, time.perf_counter()
    while True:
        if iterations % 500 == 0:  # both ranks stop at the same iteration (checked rarely: in between they drift)
            done = torch.tensor([time.perf_counter() - start >= seconds], dtype=torch.int32)
            dist.all_reduce(done)
            if done.item():
                break
        sizes = [rng.randint(1, 20000) for _ in range(rng.randint(1, 6))]
        shards = [torch.full((n,), float(rank + 1)) for n in sizes]
        if form == "per_param":
            outputs = [torch.empty(n * world) for n in sizes]
            gather = dist.group.WORLD.all_gather_single_coalesced(outputs, shards)
        else:
            rows = torch.empty(world, sum(sizes))
            gather = dist.all_gather_single(rows.view(-1), torch.cat(shards), async_op=True)
        bucket = torch.ones(rng.randint(1, 50000))
        reduce = dist.all_reduce(bucket, async_op=True)
        for _ in range(20):  # the host allocating and freeing while gloo works
            torch.randn(rng.randint(1, 5000))
        gather.wait()
        reduce.wait()
        if form == "rows":
            columns = torch.tensor([0] + sizes).cumsum(0).tolist()
            outputs = [rows[:, a:b].reshape(-1) for a, b in zip(columns, columns[1:])]
        for out, n in zip(outputs, sizes):
            assert torch.equal(out, torch.arange(1, world + 1, dtype=out.dtype).repeat_interleave(n)), "wrong values"
        assert bucket[0].item() == world, "wrong all-reduce"
        iterations += 1
    print(f"rank {rank}: {form} gathers with an all-reduce in flight beside each: {iterations} iterations in "
          f"{time.perf_counter() - start:.0f} s, all values right", flush=True)


def _agreement_cost(host: HostComm, calls: int) -> str:
    """Median microseconds of one graph-start agreement in a row of ``calls``, through gloo and through ``host``."""
    medians = {}
    for name, through in (("gloo", None), ("shm", host)):
        dist.barrier()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            assert agree(None, through, RUN) is None
            times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times) * 1e6
    return ", ".join(f"{name} {us:.0f} us" for name, us in medians.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", default="4,24", help="comma-separated bucket sizes, MiB of fp32")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--members", type=int, default=4, help="parameters in a gathered run")
    p.add_argument("--agree-calls", type=int, default=200)
    p.add_argument("--race", type=float, default=0.0, metavar="SECONDS",
                   help="run a run's gather beside an all-reduce in flight for this long instead of timing")
    p.add_argument("--race-form", choices=("rows", "per_param"), default="per_param")
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.race > 0:
        _race(args.race, args.race_form, world)
        dist.destroy_process_group()
        return
    host = HostComm(None, (1 << 20) // world * 4, REDUCE_SLOT_BYTES)  # the runtime's slots for a large model
    rank, gather_channel, reduce_channel = dist.get_rank(), host.gather, host.reduce
    for mib in (float(m) for m in args.mib.split(",")):
        numel = int(mib * 2**20 / 4) // world * world
        bucket, part, gathered = torch.randn(numel), torch.randn(numel // world), torch.empty(numel)
        shards = list(part.split(-(-part.numel() // args.members)))
        calls = {"reduce_scatter": lambda: dist.reduce_scatter_single(part, bucket),
                 "all_reduce": lambda: dist.all_reduce(bucket),
                 "all_gather": lambda: dist.all_gather_single(bucket, part),
                 "gather_rows": lambda: _gather_rows(shards, world),
                 "gather_per_param": lambda: _gather_per_param(shards, world),
                 "shm_reduce_scatter": lambda: start_sum(reduce_channel, bucket.view(world, -1), rank).wait(),
                 "shm_all_reduce": lambda: start_sum(reduce_channel, bucket.view(1, -1), None).wait(),
                 "shm_all_gather": lambda: _shm_all_gather(gather_channel, part),
                 "copy": lambda: gathered.copy_(bucket)}
        medians = {}
        for name, call in calls.items():
            times = []
            for _ in range(1 + args.repeats):
                dist.barrier()
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            medians[name] = statistics.median(times[1:])
        if dist.get_rank() == 0:
            # ours / baseline, as every benchmark prints: the runtime's form over the one it does not use
            ratio = medians["all_reduce"] / medians["reduce_scatter"]
            rows = medians["gather_rows"] / medians["gather_per_param"]
            print(f"{numel * 4 / 2**20:.1f} MiB, {world} ranks: "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items())
                  + f"; all-reduce (the runtime's reduce-scatter) / reduce-scatter {ratio:.2f}x; a run of "
                  f"{len(shards)} parameters gathered as rows / per parameter {rows:.2f}x")
    cost = _agreement_cost(host, args.agree_calls)
    if rank == 0:
        print(f"the ranks' agreement at a compiled forward graph's start, {world} ranks: {cost}")
    host.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
