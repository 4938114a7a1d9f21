# SPDX-License-Identifier: Apache-2.0
"""Time per fused cast + all-gather: native ``dsc_native::cast_all_gather`` vs the Python implementation.

    python benchmarks/bench_native_gather.py                       # 2 CPU ranks (gloo), default sizes
    python benchmarks/bench_native_gather.py --numels 4096 1048576 --iters 50 --world-size 2

Each rank holds a ZeRO-3-style padded fp32 shard; for every size and target dtype both paths run the same
number of gathers (interleaved in rounds, after a warm-up), and rank 0 prints the median time per gather of
each and the ratio native / Python (< 1: native is faster). Builds the native op first if it is not cached.
"""
import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
import multiprocessing as mp
from typing import Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()  # this checkout's deepspeed.compile, before deepspeed is imported

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Row = Tuple[int, str, float, float]  # numel, dtype, native s/gather, python s/gather


def _time_per_gather(fn, shard: torch.Tensor, dtype: torch.dtype, group, world_size: int, iters: int) -> float:
    import torch.distributed as dist
    dist.barrier(group)
    start = time.perf_counter()
    for _ in range(iters):
        fn(shard, dtype, group, world_size)
    return (time.perf_counter() - start) / iters


def _rank(rank: int, world_size: int, store_path: str, numels: List[int], dtypes: List[str], iters: int,
          rounds: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=300))
    from deepspeed.compile.native import cast_all_gather_python, load_native
    native = load_native("native")
    group = dist.group.WORLD
    rows: List[Row] = []
    for numel in numels:
        shard = torch.randn(-(-numel // world_size))
        for name in dtypes:
            dtype = DTYPES[name]
            for fn in (native, cast_all_gather_python):  # warm-up
                _time_per_gather(fn, shard, dtype, group, world_size, max(1, iters // 5))
            times: Dict[str, List[float]] = {"native": [], "python": []}
            for _ in range(rounds):
                times["native"].append(_time_per_gather(native, shard, dtype, group, world_size, iters))
                times["python"].append(_time_per_gather(cast_all_gather_python, shard, dtype, group, world_size,
                                                        iters))
            rows.append((numel, name, statistics.median(times["native"]), statistics.median(times["python"])))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numels", type=int, nargs="+", default=[4096, 65536, 1 << 20, 8 << 20],
                        help="parameter sizes (elements); each rank's shard is numel / world size, padded")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    parser.add_argument("--iters", type=int, default=30, help="gathers per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per path (median reported)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()

    from deepspeed.compile.native.gather import native_op_error
    error = native_op_error()  # build once here, so the ranks only load the cached library
    if error is not None:
        sys.exit(f"native op unavailable: {error}")

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dsc-bench-") as workdir:
        store = os.path.join(workdir, "store")
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, store, args.numels, args.dtypes, args.iters,
                                                 args.rounds, queue)) for r in range(args.world_size)]
        for p in procs:
            p.start()
        rows: List[Row] = queue.get(timeout=1800)
        for p in procs:
            p.join()
    print(f"fused cast + all-gather, fp32 shards, {args.world_size} ranks (gloo), median of {args.rounds} "
          f"rounds x {args.iters} gathers")
    print("| param numel | dtype | native (us/gather) | python (us/gather) | native / python |")
    print("|---:|---|---:|---:|---:|")
    for numel, name, t_native, t_python in rows:
        print(f"| {numel} | {name} | {t_native * 1e6:.1f} | {t_python * 1e6:.1f} | {t_native / t_python:.2f} |")


if __name__ == "__main__":
    main()
