# SPDX-License-Identifier: Apache-2.0
"""The main job: a short real training run of a small Llama with DeepCompile (ZeRO-3) on CPU ranks.

    deepspeed --num_accelerators 2 benchmarks/main_job.py --steps 12

One progress line per step (step, loss, step time) on rank 0, then a summary. The comparison against eager
ZeRO-3 is ``benchmarks/run.py`` (``scripts/main_job.sh`` runs both).
"""
import argparse
import os
import sys
import time
import warnings
from typing import List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()  # the checkout's deepspeed.compile, before deepspeed is imported

warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.models import SIZES, make_batch, make_model, parameter_count, size_of  # noqa: E402
from benchmarks.worker import ds_config  # noqa: E402


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=("gpt", "llama"))
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "autocast"))
    p.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    p.add_argument("--partitioner", default="min_cut", choices=("min_cut", "default"))
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import deepspeed
    from deepspeed.compile.report import engine_report
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = make_model(args.model, args.size, seed=0)
    n_params = parameter_count(model)
    config = ds_config(args.dtype, n_params, size_of(args.size).batch,
                       {"deepcompile": True, "partitioner": args.partitioner})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    engine.compile(backend=args.backend)
    if rank == 0:
        print(f"main job: {args.model} ({args.size}, {n_params / 1e6:.2f} M parameters), ZeRO-3 + DeepCompile "
              f"(partitioner={args.partitioner}, backend={args.backend}, {args.dtype}), "
              f"{dist.get_world_size()} CPU ranks (gloo)", flush=True)
    t_start = time.perf_counter()
    times = []
    for step in range(args.steps):
        idx, targets = make_batch(args.size, step, rank)
        t0 = time.perf_counter()
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.5f}  step time {times[-1]:.3f} s"
                  f"{'  (includes compile)' if step == 0 else ''}", flush=True)
    stats = engine_report(engine)
    if rank == 0:
        steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
        print(f"done: {args.steps} steps in {time.perf_counter() - t_start:.1f} s, first step {times[0]:.2f} s, "
              f"median step {steady:.3f} s", flush=True)
        if stats is None:
            print("engine report: n/a (the engine is not running DeepCompile)")
        else:
            print("engine report: " + ", ".join(f"{k}={v}" for k, v in stats.items()), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
