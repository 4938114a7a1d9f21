# SPDX-License-Identifier: Apache-2.0
"""Run a test function on several CPU ranks (gloo, file store), each rank a fresh process.

    results = run_distributed(fn, arg, world_size=2, timeout_s=120)

``fn`` must be a module-level function (it is imported by name in each rank, after the checkout's
``deepspeed.compile`` is put in place). Each rank returns ``fn(*args)``; an exception in any rank fails the
call with that rank's traceback (:class:`RankFailure`), and a rank that has not finished within ``timeout_s``
(a hung collective, a deadlock) is killed and reported (:class:`RankTimeout`), so one broken test never hangs
the suite. Once a rank has failed, the others get ``failure_grace_s`` (default ``FAILURE_GRACE_S``) to finish (and
report their own failure) before they are killed: they would otherwise wait in a collective the failed rank never
joins.
Whatever ends the call (a result, a failure, pytest-timeout's exception, Ctrl-C), no rank outlives it.

Each rank's stdout and stderr go to a log of its own, written to the caller's stderr when the call ends (pytest shows
it with a failed test). A rank that dies of a signal (an abort in gloo's or torch's C++, a segfault) writes every
thread's Python stack there first (``faulthandler``), and so does a rank killed for running late; the failure's
message ends with the last lines of the log of each rank that crashed or was killed.

A rank ends with ``os._exit`` as soon as its result is written: the interpreter's teardown (Python finalization,
the static destructors of torch, gloo and DeepSpeed's shm op) never runs in a rank, and a rank's exit status is not
read once its result is in, so an abort in that teardown (``scripts/exit_abort/``) can neither fail nor flake a test.

Each rank is forked from a server process that imported torch, DeepSpeed and the test helpers once
(``multiprocessing``'s forkserver with a preload list): a fresh process with nothing initialized, as a spawned
one, without paying 5 s of imports per rank and call. It runs with the caller's environment at the call.

``timeout_s`` must leave room under pytest's own per-test timeout (``pyproject.toml``), so that a hung rank
is reported by this harness, with its name, rather than by pytest-timeout.
"""
import datetime
import faulthandler
import importlib
import os
import pickle
import signal
import sys
import tempfile
import time
import tomllib
import traceback
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
from typing import Any, Callable, List, Optional

import checkout  # noqa: F401  (before anything imports deepspeed)


def _pytest_timeout_s() -> float:
    with open(os.path.join(checkout.REPO_ROOT, "pyproject.toml"), "rb") as f:
        return float(tomllib.load(f)["tool"]["pytest"]["ini_options"]["timeout"])


PYTEST_TIMEOUT_S = _pytest_timeout_s()
# spawning the ranks, killing them and reading their results, all inside pytest's timeout
TEARDOWN_MARGIN_S = 30.0
MAX_TIMEOUT_S = PYTEST_TIMEOUT_S - TEARDOWN_MARGIN_S
FAILURE_GRACE_S = 10.0
# a rank to be killed is first asked for its threads' stacks (SIGUSR1, faulthandler) and given this long to write them
STACKS_GRACE_S = 1.0
# lines of a crashed or killed rank's log quoted in the failure's message
LOG_TAIL_LINES = 80


class RankFailure(AssertionError):
    """A rank raised (or died without a result); the message carries its traceback."""


class RankTimeout(AssertionError):
    """A rank did not finish in time (most likely a hung collective), and no rank failed."""


# imported once by the fork server, so that no rank imports them again; nothing here starts a thread or touches
# torch.distributed (forking a process with threads is not safe). A module that fails to import is skipped.
PRELOAD = ["checkout", "torch", "torch.distributed", "deepspeed", "deepspeed.compile", "transformers",
           "models", "training", "compare",
           # imported lazily, by every rank that compiles or builds a model, at 5 s a rank in all (measured): dynamo
           # and inductor (on the first compile; DeepSpeed's ZeRO optimizers import dynamo too), sympy's units
           # (sympy's simplify, on inductor's first C++ kernel), the test models' transformers modules
           "torch._dynamo", "torch._inductor.compile_fx", "sympy.physics", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2", "deepspeed.compile.driver.compiler",
           # DeepSpeed's ZeRO optimizers import it on every engine, and it compiles a function at import
           "deepspeed.runtime.zero.muon.muon_optimizer",
           "forkserver_ready"]  # last: one-time probes, then the heap frozen
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)
HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))


def _ensure_fork_server() -> None:
    """Start the fork server (once) with this directory on its path. Python 3.11's server imports its preload list
    with the interpreter's default path, not the caller's, so the helpers above failed to import there (silently)
    and every rank imported them again, and ran without ``forkserver_ready``'s frozen heap; ``PYTHONPATH`` reaches
    it on every Python version. The caller's environment is restored at once: the ranks get it whole."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([HELPERS_DIR] + ([saved] if saved else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _rank_main(module_name: str, fn_name: str, args: tuple, rank: int, world_size: int, workdir: str,
               collective_timeout_s: float, environ: dict) -> None:
    os.environ.clear()  # the caller's environment at the call, not the fork server's at its start
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    # the fork server's stdout and stderr are whatever they were when the first call started it (under pytest a
    # capture file read long ago): each rank logs to a file of its own instead, C++ writes (gloo's abort) included
    log = os.open(_log_path(workdir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable(all_threads=True)  # SIGSEGV, SIGABRT, ...: every thread's Python stack, then the default
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks a rank it is about to kill
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
    _save_coverage()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads of a failed rank must not block exit


def _save_coverage() -> None:
    """Under ``scripts/coverage.sh`` (coverage.py started in every process), write this rank's measurement, which
    ``os._exit`` would otherwise lose."""
    if "coverage" not in sys.modules:
        return
    cov = sys.modules["coverage"].Coverage.current()
    if cov is not None:
        cov.stop()
        cov.save()


def _log_path(workdir: str, rank: int) -> str:
    return os.path.join(workdir, f"rank{rank}.log")


def _log_tail(workdir: str, rank: int) -> str:
    try:
        with open(_log_path(workdir, rank), errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _kill(procs: List[mp.Process], ranks: List[int]) -> None:
    """Kill ``ranks``, each asked for its threads' stacks first (faulthandler writes them to its log from the signal
    handler and the rank runs on)."""
    for rank in ranks:
        try:
            os.kill(procs[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:  # it has just exited
            pass
    if ranks:
        time.sleep(STACKS_GRACE_S)
    for rank in ranks:
        procs[rank].kill()


def _outcome(workdir: str, rank: int) -> Optional[tuple]:
    path = os.path.join(workdir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _wait(procs: List[mp.Process], workdir: str, timeout_s: float, grace_s: float) -> None:
    """Wait until every rank has exited, the deadline has passed, or a rank failed ``grace_s`` ago."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while True:
        alive = [p for p in procs if p.is_alive()]
        now = time.monotonic()
        if failed_at is None and any(not p.is_alive() and (_outcome(workdir, r) or ("error", ))[0] != "ok"
                                     for r, p in enumerate(procs)):
            failed_at = now
        if not alive or now >= deadline or (failed_at is not None and now - failed_at >= grace_s):
            return
        end = deadline if failed_at is None else min(deadline, failed_at + grace_s)
        mp.connection.wait([p.sentinel for p in alive], timeout=max(0.0, end - now))


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, timeout_s: float = 180.0,
                    collective_timeout_s: float = 60.0, failure_grace_s: float = FAILURE_GRACE_S) -> List[Any]:
    if timeout_s > MAX_TIMEOUT_S:
        raise ValueError(f"run_distributed(timeout_s={timeout_s}): must be at most {MAX_TIMEOUT_S:.0f} s, under "
                         f"pytest's timeout of {PYTEST_TIMEOUT_S:.0f} s (pyproject.toml) with room to clean up")
    _ensure_fork_server()
    with tempfile.TemporaryDirectory(prefix="dsc-dist-") as workdir:
        procs = [_CONTEXT.Process(target=_rank_main, daemon=True,
                                  args=(fn.__module__, fn.__name__, args, rank, world_size, workdir,
                                        collective_timeout_s, dict(os.environ)))
                 for rank in range(world_size)]
        try:
            for p in procs:
                p.start()
            _wait(procs, workdir, timeout_s, failure_grace_s)
        finally:  # also when pytest-timeout (or anything else) interrupts the wait: no rank may outlive the test
            still_running = [rank for rank, p in enumerate(procs) if p.pid is not None and p.is_alive()]
            _kill(procs, still_running)
            for p in procs:
                if p.pid is not None:
                    p.join()
            for rank in range(world_size):  # pytest shows the caller's stderr with a failed test
                if os.path.exists(_log_path(workdir, rank)):
                    sys.stderr.write(f"--- rank {rank} log ---\n")
                    with open(_log_path(workdir, rank), errors="replace") as f:
                        sys.stderr.write(f.read())
        outcomes = [_outcome(workdir, rank) for rank in range(world_size)]
        tails = {rank: _log_tail(workdir, rank) for rank, o in enumerate(outcomes) if o is None}
    errors = [(rank, o[1]) for rank, o in enumerate(outcomes) if o is not None and o[0] == "error"]
    missing = [f"rank {rank} (exit code {procs[rank].exitcode})" for rank, o in enumerate(outcomes)
               if o is None and rank not in still_running]
    if errors or missing:
        message = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in errors)
        if missing:
            message += f"\n{fn.__name__}: {', '.join(missing)} exited without a result (crashed)"
        if still_running:
            message += (f"\n{fn.__name__}: rank(s) {still_running} were still running "
                        f"{failure_grace_s:.0f} s after the first failure and were killed")
        raise RankFailure(message + _tails_text(tails))
    if still_running:
        raise RankTimeout(f"{fn.__name__}: rank(s) {still_running} did not finish within {timeout_s:.0f} s"
                          + _tails_text(tails))
    return [o[1] for o in outcomes]


def _tails_text(tails: dict) -> str:
    """The last lines of each crashed or killed rank's log: its abort message, its threads' stacks."""
    return "".join(f"\n--- rank {rank}: last {LOG_TAIL_LINES} lines of its log ---\n{tail}"
                   for rank, tail in sorted(tails.items()))
