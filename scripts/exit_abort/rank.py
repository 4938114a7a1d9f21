# SPDX-License-Identifier: Apache-2.0
"""One rank of the exit-abort hunt: stock eager ZeRO-3 on a tiny model for a few steps, a chosen teardown, then an
ordinary interpreter exit (static destructors and all), which is where the abort was reported.

    torchrun --standalone --nproc_per_node 2 scripts/exit_abort/rank.py --steps 3 --teardown process_group

Nothing of deepspeed-compile is used unless ``--deepcompile``. ``--profile`` runs the steps under
``torch.profiler`` (CPU activity, ``profile_memory=True``), as the benchmarks' memory measurement does. Before it
exits, each rank prints the names of its live native threads: the candidates whose destructor could find them
joinable (``--show-holders``: and what still references a process group).
"""
import argparse
import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist

TEARDOWNS = ("none", "process_group", "engine_then_process_group", "release_then_process_group")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--teardown", choices=TEARDOWNS, default="process_group",
                   help="what the script ends before exiting: nothing, the process group, engine.destroy() first, or "
                        "engine.destroy() and every reference to the engine and model dropped first")
    p.add_argument("--profile", action="store_true", help="run the steps under torch.profiler(profile_memory=True)")
    p.add_argument("--deepcompile", action="store_true", help="engine.compile() with DeepCompile (eager backend)")
    p.add_argument("--show-holders", action="store_true",
                   help="after the teardown, print which module globals and attributes still hold a ProcessGroup")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    return p.parse_args()


def live_thread_names() -> list:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


def process_group_holders() -> list:
    """Where ProcessGroup objects are still referenced: module globals, and the keys of objects' attribute dicts
    (pybind objects are not tracked by the collector, their holders are)."""
    found = []
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            found += [f"attribute {key}" for key, value in list(obj.items()) if isinstance(value, dist.ProcessGroup)]
    for name, module in list(sys.modules.items()):
        found += [f"global {name}.{key}" for key, value in list(vars(module).items() if module else [])
                  if isinstance(value, dist.ProcessGroup)]
    return sorted(set(found))


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    if args.deepcompile:
        config["compile"] = {"deepcompile": True}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    if args.deepcompile:
        engine.compile(backend="eager")
    profiler = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        profiler.start()
    for _ in range(args.steps):
        loss = engine(torch.randn(4, 16)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    if profiler is not None:
        profiler.stop()
    rank = dist.get_rank()
    if args.teardown in ("engine_then_process_group", "release_then_process_group"):
        engine.destroy()
    if args.teardown == "release_then_process_group":
        del engine, model, _
        gc.collect()
    if args.teardown != "none":
        dist.destroy_process_group()
        gc.collect()
    if args.show_holders:
        print(f"rank {rank}: process groups still referenced by {process_group_holders()}", flush=True)
    print(f"rank {rank}: teardown {args.teardown} done; live threads {live_thread_names()}", flush=True)


if __name__ == "__main__":
    main()
