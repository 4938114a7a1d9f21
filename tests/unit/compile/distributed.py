"""Run a test function on several CPU ranks (gloo, file store), each rank a fresh spawned process.

    results = run_distributed(fn, arg, world_size=2, timeout_s=120)

``fn`` must be a module-level function (it is imported by name in each rank, after the checkout's
``deepspeed.compile`` is put in place). Each rank returns ``fn(*args)``; an exception in any rank fails the
call with that rank's traceback, and a rank that has not finished within ``timeout_s`` (a hung collective,
a deadlock) is killed and reported, so one broken test never hangs the suite.
"""
import datetime
import importlib
import os
import pickle
import tempfile
import time
import traceback
import multiprocessing as mp
from typing import Any, Callable, List

import checkout  # noqa: F401  (before anything imports deepspeed)


class RankFailure(AssertionError):
    """A rank raised; the message carries its traceback."""


class RankTimeout(AssertionError):
    """A rank did not finish in time (most likely a hung collective)."""


def _rank_main(module_name: str, fn_name: str, args: tuple, rank: int, world_size: int, workdir: str,
               collective_timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    result_path = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        fn = getattr(importlib.import_module(module_name), fn_name)
        outcome = ("ok", fn(*args))
    except BaseException:  # report everything, including SystemExit from a test helper
        outcome = ("error", traceback.format_exc())
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(result_path + ".tmp", result_path)
    os._exit(0)  # skip interpreter teardown: gloo threads of a failed rank must not block exit


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, timeout_s: float = 180.0,
                    collective_timeout_s: float = 60.0) -> List[Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dsc-dist-") as workdir:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn.__module__, fn.__name__, args, rank, world_size, workdir, collective_timeout_s))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for rank in range(world_size):
            path = os.path.join(workdir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes.append(pickle.load(f))
            else:
                outcomes.append(None)
    errors = [(rank, o[1]) for rank, o in enumerate(outcomes) if o is not None and o[0] == "error"]
    if errors:
        raise RankFailure("\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in errors))
    if hung:
        raise RankTimeout(f"{fn.__name__}: rank(s) {hung} did not finish within {timeout_s:.0f} s")
    missing = [f"rank {rank} (exit code {procs[rank].exitcode})" for rank, o in enumerate(outcomes) if o is None]
    if missing:
        raise RankFailure(f"{fn.__name__}: {', '.join(missing)} exited without a result (crashed)")
    return [o[1] for o in outcomes]
