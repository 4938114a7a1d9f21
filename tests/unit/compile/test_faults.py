# SPDX-License-Identifier: Apache-2.0
"""Faults a real cluster produces, on a compiled engine: a shared-memory directory the ranks do not share or that is
too small (``"auto"`` agrees to use the process group and trains bitwise as eager ZeRO-3), a peer that exits
mid-training (the survivor raises within seconds, naming it, on either transport), one rank's compile failing or one
rank alone reaching dynamo's recompile limit (every rank stops that step, the others naming the rank and the cause,
and all go on as eager ZeRO-3 together, on either transport), and the engine's destroy (nothing left in the
directory, nothing mapped)."""
import os
import re
import tempfile
import time

import pytest
import torch

from compare import assert_bitwise_equal, assert_ran_compiled, run_pair
from distributed import run_distributed
from test_host_comm import _mapped_segments, _small_tmpfs


def _rank_pair_in(dirs: list) -> dict:
    """Eager ZeRO-3 and the compiled engine with ``host_comm: "auto"`` in this rank's directory of ``dirs``."""
    import torch.distributed as dist
    directory = dirs[int(os.environ["RANK"]) % len(dirs)]
    r = run_pair("gpt", 3, compile_section={"host_comm": "auto", "host_comm_dir": directory})
    dist.barrier()
    r["left"] = os.listdir(directory)
    r["mapped"] = len(_mapped_segments())
    return r


def _check_fell_back_to_the_process_group(results: list) -> None:
    for r in results:
        assert r["host_comm"] == "gloo", r["host_comm"]
        assert r["left"] == [] and r["mapped"] == 0, (r["left"], r["mapped"])
        assert_ran_compiled(r)
        assert_bitwise_equal(r)


def test_ranks_on_one_host_with_separate_shm_directories_train_through_the_process_group():
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        _check_fell_back_to_the_process_group(run_distributed(_rank_pair_in, [a, b], timeout_s=150))


def test_a_shm_directory_too_small_for_the_segments_trains_through_the_process_group():
    directory = _small_tmpfs(1)  # the model's segments need more than 1 MiB a rank
    try:
        _check_fell_back_to_the_process_group(run_distributed(_rank_pair_in, [directory], timeout_s=150))
    finally:
        os.system(f"umount {directory}")
        os.rmdir(directory)


def _rank_destroyed(directory: str) -> dict:
    from models import ds_config
    from training import make_engine, train
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True, "host_comm": "shm", "host_comm_dir": directory}))
    engine.compile(backend="eager")
    train(engine, "gpt", 1)
    mapped_while_training = len(_mapped_segments())
    engine.destroy()
    return {"while": mapped_while_training, "after": len(_mapped_segments()), "left": os.listdir(directory)}


def test_destroy_returns_the_segments():
    with tempfile.TemporaryDirectory() as directory:
        for r in run_distributed(_rank_destroyed, directory, timeout_s=120):
            assert r == {"while": 2, "after": 0, "left": []}, r


def _rank_peer_exits(host_comm: str) -> dict:
    """Rank 1 leaves after its first step (the harness ends its process): rank 0's next step must raise."""
    from models import ds_config
    from training import make_engine, train
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True, "host_comm": host_comm}))
    engine.compile(backend="eager")
    train(engine, "gpt", 1)
    if torch.distributed.get_rank() == 1:
        return {"rank": 1}
    t0 = time.monotonic()
    message, runtime_error = "completed", False
    try:
        train(engine, "gpt", 2, first_step=1)
    except Exception as err:  # gloo's error, or ours: the test checks which
        message, runtime_error = f"{type(err).__name__}: {err}", isinstance(err, RuntimeError)
    return {"rank": 0, "message": message, "runtime_error": runtime_error, "seconds": time.monotonic() - t0,
            "host_comm": engine._deepspeed_compile.runtime.host_comm}


# what gloo says when the peer's end of a connection is gone: on a read ("Read error ...: Connection reset by peer"),
# a connection closed in an orderly way, or a write
GLOO_DEAD_PEER = r"Connection reset by peer|Connection closed by peer|Broken pipe"


@pytest.mark.parametrize("host_comm", ["shm", "gloo"])
def test_a_peer_that_exits_mid_training_makes_the_survivor_raise_within_seconds(host_comm):
    # the process group's timeout here is 60 s (the harness's): both transports must notice the peer well before it
    r = next(r for r in run_distributed(_rank_peer_exits, host_comm, timeout_s=120) if r["rank"] == 0)
    assert r["host_comm"] == host_comm
    assert r["message"] != "completed" and r["seconds"] < 30, r
    if host_comm == "shm":
        assert "rank 1 exited" in r["message"], r
    else:  # gloo's own error for a socket whose peer is gone, as torch raises it (DistBackendError is one)
        assert r["runtime_error"] and re.search(GLOO_DEAD_PEER, r["message"]), r


def _compile_fails_on_rank_1(direction: str, host_comm: str, stage: int, section: dict, zero: dict) -> dict:
    """Rank 1's compile of its first ``direction`` graph fails (an injected error; a backward is compiled by
    AOTAutograd lazily, inside the first ``backward()``), rank 0's succeeds. Both must stop in that step, rank 0
    naming rank 1 and the cause, and both then train as eager ZeRO."""
    from deepspeed.compile.driver import compiler
    from models import ds_config, make_batch
    from training import make_engine, train
    rank = torch.distributed.get_rank()
    eager = make_engine("gpt", ds_config(stage, zero_overrides=zero))
    eager_losses = train(eager, "gpt", 2, first_step=1)  # the failed step is skipped
    eager.destroy()
    if rank == 1:
        def broken(self, gm, example_inputs):
            raise RuntimeError(f"an injected {direction} compile failure")
        setattr(compiler.GraphCompiler, f"_compile_{direction}", broken)
    torch._dynamo.reset()  # a fresh start for each engine of a launch (its graphs compiled, and failing, again)
    engine = make_engine("gpt", ds_config(stage, {"deepcompile": True, "host_comm": host_comm, **section},
                                          zero_overrides=zero))
    engine.compile(backend="eager")
    t0 = time.monotonic()
    try:
        _step(engine, make_batch("gpt", 0, rank))  # ZeRO-3 stops in its forward graph, ZeRO-1/2 in the backward
        raised = None
    except Exception as err:
        raised = f"{type(err).__name__}: {err}"
    out = {"raised": raised, "seconds": time.monotonic() - t0, "active": engine.is_deepcompile_active(),
           "losses": train(engine, "gpt", 2, first_step=1), "eager_losses": eager_losses,
           "host_comm": engine._deepspeed_compile.runtime.host_comm}
    engine.destroy()
    return out


def _backward_compile_fails_on_rank_1(cases: list, zero: dict) -> list:
    """:func:`_compile_fails_on_rank_1` with its backward, for each (transport, stage) of ``cases`` in turn, in one
    launch (rank 1's compile of a backward keeps failing)."""
    return [_compile_fails_on_rank_1("backward", host_comm, stage, {}, zero) for host_comm, stage in cases]


@pytest.mark.parametrize("host_comm, agree, stage", [("shm", False, 3), ("shm", True, 3), ("gloo", True, 3),
                                                    ("shm", True, 2), ("gloo", True, 2), ("gloo", True, 1)])
def test_one_ranks_compile_failure_stops_every_rank_then_all_run_eager_zero_together(host_comm, agree, stage):
    """Through shared memory the failure is posted (the peers' next wait raises); with ``agree_on_failures`` (the
    default) the ranks agree before the graph's first collective, on either transport. At ZeRO-1/2 that is before the
    first gradient the peers' backward accumulates (the failing rank waits there through their forward), and the
    abandoned backward leaves no gradient behind: the next steps are eager ZeRO's."""
    results = run_distributed(_compile_fails_on_rank_1, "forward", host_comm, stage, {"agree_on_failures": agree}, {},
                              timeout_s=150)
    _check_stopped_together(results, host_comm, "RuntimeError: an injected forward compile failure",
                            "rank 1 failed: compiling a graph failed (RuntimeError: an injected forward compile "
                            "failure)")


@pytest.mark.parametrize("cases, reuse_distance", [([("shm", 3)], 0), ([("gloo", 3)], 0), ([("gloo", 3)], 10**9),
                                                    ([("shm", 2), ("gloo", 2), ("gloo", 1)], 0)],
                         ids=["zero3-shm", "zero3-gloo", "zero3-gloo-kept", "zero1-and-2"])
def test_one_ranks_backward_compile_failure_stops_every_rank_in_that_backward(cases, reuse_distance):
    """The peers' backward agrees before its first collective (its start is marked when the first gradient reaches
    the forward graph's outputs), so a backward that only rank 1 failed to compile stops both ranks there
    (``agree_on_failures``, on by default), on either transport. Its first collective is a gather where nothing was
    kept from forward (reuse distance 0), a reduce where everything was (DeepSpeed's default reuse distance); at
    ZeRO-1/2 the first gradient handed to ZeRO (ZeRO-2 on either transport, in one launch with ZeRO-1, whose reduces
    are ZeRO's own, through the process group)."""
    by_case = zip(*run_distributed(_backward_compile_fails_on_rank_1, cases,
                                   {"stage3_max_reuse_distance": reuse_distance}, timeout_s=240))
    for (host_comm, _), results in zip(cases, by_case):
        _check_stopped_together(list(results), host_comm, "RuntimeError: deepspeed-compile: compiling a backward "
                                "graph failed (RuntimeError: an injected backward compile failure)",
                                "StepAbandoned: deepspeed-compile: rank 1 failed: compiling a graph failed "
                                "(RuntimeError: an injected backward compile failure)")


def _agreements_a_step() -> dict:
    """Agreements in each of two steps after the first, and the forward graphs compiled, whole model and by block."""
    from models import ds_config
    from training import make_engine, train
    found = {}
    for regions in ("model", "blocks"):
        # prefetch on: a graph's gathers go out as runs (runtime/z3_runs.py), the first before the graph's first use
        engine = make_engine("gpt", ds_config(3, {"deepcompile": True, "host_comm": "gloo", "regions": regions},
                                              zero_overrides={"stage3_prefetch_bucket_size": 20000}))
        train(engine, "gpt", 1, compile_kwargs={"backend": "eager"})
        state = engine._deepspeed_compile
        counts = []
        for step in (1, 2):
            before = state.runtime.peers.agreements
            train(engine, "gpt", 1, first_step=step)
            counts.append(state.runtime.peers.agreements - before)
        found[regions] = (counts, state.stats.graphs_compiled)
        engine.destroy()
    return found


def test_every_graph_agrees_once_in_its_forward_and_once_in_its_backward():
    """The agreement's cost, counted: at most one a graph in forward and one in backward (each a float32 a rank), and
    the same every step. Whole model: one graph, two. Block by block: a graph a block and the head's, where a graph
    whose gathers a run started before it issues no collective of its own and its agreement is the next one's."""
    for found in run_distributed(_agreements_a_step):
        assert found["model"] == ([2, 2], 1), found
        counts, graphs = found["blocks"]
        assert graphs > 1 and graphs < counts[0] <= 2 * graphs and counts[0] == counts[1], found


def _step(engine, batch) -> float:
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _rank_stops_at_step_1(host_comm: str, new_length_on_rank_1, engine_kwargs: dict, prepare=None) -> dict:
    """Steps 0-3 on eager ZeRO-3 (step 1 skipped) and on the compiled engine, where step 1 gives rank 1 alone a batch
    of a new length, ``new_length_on_rank_1`` being what rank 1 does with it; ``prepare(rank)`` runs first."""
    from models import ds_config, make_batch
    from training import make_engine
    rank = torch.distributed.get_rank()

    def batch(step):
        x, y = make_batch("gpt", step, rank)
        return (x[:, :12], y[:, :12]) if step == 1 and rank == 1 else (x, y)

    eager = make_engine("gpt", ds_config(3))
    eager_losses = [_step(eager, batch(n)) for n in (0, 2, 3)]
    eager.destroy()
    counted = prepare(rank) if prepare is not None else []
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True, "host_comm": host_comm,
                                              "agree_on_failures": True}))
    engine.compile(backend="eager", **engine_kwargs)
    losses = [_step(engine, batch(0))]
    t0 = time.monotonic()
    try:
        _step(engine, batch(1))
        raised = None
    except Exception as err:
        raised = f"{type(err).__name__}: {err}"
    seconds = time.monotonic() - t0
    active = engine.is_deepcompile_active()
    losses += [_step(engine, batch(n)) for n in (2, 3)]
    return {"raised": raised, "seconds": seconds, "active": active, "compiles": len(counted), "losses": losses,
            "eager_losses": eager_losses, "host_comm": engine._deepspeed_compile.runtime.host_comm}


def _check_stopped_together(results: list, host_comm: str, own: str, named: str) -> None:
    """Rank 1 raised its own error (``own`` in it), rank 0 one naming rank 1 (``named``), both within seconds; both
    then trained as eager ZeRO-3 would."""
    rank0, rank1 = results
    assert own in rank1["raised"], rank1
    assert named in rank0["raised"], rank0
    for r in results:
        assert r["host_comm"] == host_comm, r
        assert r["seconds"] < 30, r  # agreed at once, not at a timeout (the harness's process group waits 60 s)
        assert not r["active"], r
        assert r["losses"] == r["eager_losses"], r


def _fail_second_compile_on_rank_1(rank: int) -> list:
    from deepspeed.compile.driver import compiler
    compiles = []
    original = compiler.GraphCompiler._compile_forward

    def second_fails_on_rank_1(self, gm, example_inputs):
        compiles.append(1)
        if rank == 1 and len(compiles) > 1:
            raise RuntimeError("an injected failure compiling the new length")
        return original(self, gm, example_inputs)

    compiler.GraphCompiler._compile_forward = second_fails_on_rank_1
    return compiles


@pytest.mark.parametrize("host_comm", ["shm", "gloo"])
def test_a_batch_that_fails_to_compile_on_one_rank_stops_every_rank_then_all_run_eager_zero3_together(host_comm):
    """Rank 1 alone compiles again (its batch has a new length) and that compile fails, while rank 0 runs the graph
    it has: both stop in that step and go on as eager ZeRO-3 together."""
    results = run_distributed(_rank_stops_at_step_1, host_comm, "compiles again and fails", {},
                              _fail_second_compile_on_rank_1, timeout_s=150)
    assert [r["compiles"] for r in results] == [1, 2], results  # only rank 1 compiled again
    _check_stopped_together(results, host_comm, "RuntimeError: an injected failure compiling the new length",
                            "rank 1 failed: compiling a graph failed (RuntimeError: an injected failure compiling the "
                            "new length)")


def _recompile_limit_1_on_rank_1(rank: int) -> list:
    if rank == 1:
        torch._dynamo.config.recompile_limit = 1
    return []


@pytest.mark.parametrize("host_comm", ["shm", "gloo"])
def test_a_recompile_limit_reached_on_one_rank_only_stops_every_rank_then_all_run_eager_zero3_together(host_comm):
    """Static shapes and a recompile limit of 1 on rank 1 only: at rank 1's new length dynamo would run the model
    uncompiled there (gathering through ZeRO-3's own collectives) while rank 0 runs its graph. Both stop in that
    step, rank 0 naming rank 1 and the limit, and go on as eager ZeRO-3 together."""
    results = run_distributed(_rank_stops_at_step_1, host_comm, "reaches the recompile limit",
                              {"compile_kwargs": {"dynamic": False}}, _recompile_limit_1_on_rank_1, timeout_s=150)
    limit = "rank 1 reached the recompile limit: torch._dynamo.config.recompile_limit (1)"
    _check_stopped_together(results, host_comm, limit, limit)


def _rank_evaluates_alone_at_zero2() -> dict:
    """ZeRO-2: rank 0 alone evaluates the compiled module under ``no_grad`` (as ``generate`` on the main process
    does) between two training steps; its forward graphs issue no collective, so it needs no peer."""
    from models import ds_config, make_batch
    from training import make_engine, train
    rank = torch.distributed.get_rank()
    eager = make_engine("gpt", ds_config(2))
    eager_losses = train(eager, "gpt", 2)
    eager.destroy()
    engine = make_engine("gpt", ds_config(2, {"deepcompile": True}))
    engine.compile(backend="eager")
    losses = train(engine, "gpt", 1)
    t0 = time.monotonic()
    if rank == 0:
        with torch.no_grad():
            for step in range(2):
                engine.module(*make_batch("gpt", step, rank))
    seconds = time.monotonic() - t0
    losses += train(engine, "gpt", 1, first_step=1)
    from compare import compiled_record
    return {"seconds": seconds, "losses": losses, "eager_losses": eager_losses, "ran": compiled_record(engine)}


def test_zero2_evaluation_on_one_rank_alone_needs_no_peer():
    rank0, rank1 = run_distributed(_rank_evaluates_alone_at_zero2, timeout_s=120)
    assert rank0["seconds"] < 20, rank0
    for r in (rank0, rank1):
        # still compiled (every gradient of both steps from the compiled backward), and the ranks still in step
        assert_ran_compiled(r["ran"])
        assert r["losses"] == r["eager_losses"], r
