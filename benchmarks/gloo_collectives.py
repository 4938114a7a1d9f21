"""What gloo's collectives cost on this machine for a gradient bucket: its reduce-scatter against an all-reduce of the
same buffer (what the ZeRO-3 runtime issues instead on gloo, ``runtime/z3_reduce.py``), and an all-gather of the
same output size. And for a run of parameters gathered in one collective (``runtime/z3_runs.py``), of the same
total gathered size split into ``--members`` parameters: received as rows and each parameter copied out of them
(``gather_rows``), against received straight into each parameter's own buffer (``gather_per_param``, gloo's
``all_gather_single_coalesced``, what the runtime issues on gloo).

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py [--mib 4,24]

For each size (MiB of fp32 sent by each rank to the reduce), rank 0 prints the median over ``--repeats`` timed calls
(after one untimed) of each collective, every call started after a barrier so both ranks start it together.
"""
import argparse
import statistics
import time
from typing import List

import torch
import torch.distributed as dist


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", default="4,24", help="comma-separated bucket sizes, MiB of fp32")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--members", type=int, default=4, help="parameters in a gathered run")
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for mib in (float(m) for m in args.mib.split(",")):
        numel = int(mib * 2**20 / 4) // world * world
        bucket, part = torch.randn(numel), torch.empty(numel // world)
        shards = list(part.split(-(-part.numel() // args.members)))
        calls = {"reduce_scatter": lambda: dist.reduce_scatter_single(part, bucket),
                 "all_reduce": lambda: dist.all_reduce(bucket),
                 "all_gather": lambda: dist.all_gather_single(bucket, part),
                 "gather_rows": lambda: _gather_rows(shards, world),
                 "gather_per_param": lambda: _gather_per_param(shards, world)}
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
            ratio = medians["reduce_scatter"] / medians["all_reduce"]
            per_param = medians["gather_per_param"] / medians["gather_rows"]
            print(f"{numel * 4 / 2**20:.1f} MiB, {world} ranks: "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items())
                  + f"; reduce-scatter / all-reduce {ratio:.2f}x; a run of {len(shards)} parameters gathered per"
                  f" parameter / as rows {per_param:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
