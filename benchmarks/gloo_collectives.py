"""What gloo's collectives cost on this machine for a gradient bucket: its reduce-scatter against an all-reduce of the
same buffer (what the ZeRO-3 runtime issues instead on gloo, ``runtime/z3_reduce.py``), and an all-gather of the
same output size.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py [--mib 4,24]

For each size (MiB of fp32 sent by each rank to the reduce), rank 0 prints the median over ``--repeats`` timed calls
(after one untimed) of each collective, every call started after a barrier so both ranks start it together.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", default="4,24", help="comma-separated bucket sizes, MiB of fp32")
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    for mib in (float(m) for m in args.mib.split(",")):
        numel = int(mib * 2**20 / 4) // world * world
        bucket, part = torch.randn(numel), torch.empty(numel // world)
        calls = {"reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(part, bucket),
                 "all_reduce": lambda: dist.all_reduce(bucket),
                 "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(bucket, part)}
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
            ratio = medians["reduce_scatter_tensor"] / medians["all_reduce"]
            print(f"{numel * 4 / 2**20:.1f} MiB, {world} ranks: "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items())
                  + f"; reduce-scatter / all-reduce {ratio:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
