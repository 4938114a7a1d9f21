# SPDX-License-Identifier: Apache-2.0
"""Collectives through shared memory between the ranks of one host (``runtime/host_comm.py``): every rank reads what
every rank sent, in any order of waits, with more collectives in flight than slots, and across channels waited in
different orders on different ranks; set-up that cannot work anywhere (a small or unshared directory) is agreed by
every rank and leaves nothing behind; ranks that start different collectives, a peer that exits, closes or fails,
and a peer that never joins end the wait with an error (or at its timeout) instead of hanging."""
import datetime
import os
import random
import subprocess
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from deepspeed.compile.runtime.host_comm import HostComm, HostCommError, open_host_comm, start_sum
from distributed import run_distributed
from machine import unavailable_here

WAIT = datetime.timedelta(seconds=60)


def _sent(seq: int, rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 1000.0 * seq + 0.5 * rank


def _start_sent(channel, seq: int, numel: int, rank: int):
    data = _sent(seq, rank, numel)
    return channel.start(4 * numel, lambda slot, d=data: slot.view(torch.float32).copy_(d),
                         lambda rows: [r.view(torch.float32).clone() for r in rows], dtype=torch.float32)


def _received_right(result, seq: int, world: int) -> bool:
    return all(torch.equal(result[r], _sent(seq, r, result[r].numel())) for r in range(world))


def _rank_channel(slots: int, count: int, seed: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = HostComm(None, 0, 4 * 64, reduce_slots=slots).reduce
    rng = random.Random(seed)  # the same choices on every rank: the same collectives in the same order
    started, results, waits = [], {}, []
    for seq in range(count):
        numel = rng.randint(1, 64)
        started.append((seq, _start_sent(channel, seq, numel, rank)))
        # wait for a random one of those started, sometimes none, sometimes several
        while started and rng.random() < 0.4:
            seq_done, work = started.pop(rng.randrange(len(started)))
            assert work.wait(WAIT)
            results[seq_done] = work.result
            waits.append(seq_done)
    for seq, work in started:
        assert work.wait(WAIT)
        results[seq] = work.result
    ok = all(_received_right(results[seq], seq, world) for seq in results)
    return {"ok": ok, "count": len(results), "out_of_order": waits != sorted(waits)}


def test_every_rank_reads_what_every_rank_sent_in_any_order_with_more_in_flight_than_slots():
    for r in run_distributed(_rank_channel, 3, 60, 7, timeout_s=120):
        assert r["ok"] and r["count"] == 60
        assert r["out_of_order"]  # the waits did not simply follow the starts


def _rank_cross_channels() -> dict:
    """One slot a channel, two collectives on each: rank 0 waits for the gathers first, rank 1 for the reduces. Neither
    rank's second collective of a channel can be written before the other has read its first, so each rank's first
    wait completes only if it moves the channel it does not wait on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    host = HostComm(None, 4 * 64, 4 * 64, gather_slots=1, reduce_slots=1)
    # rank 0 starts all four before rank 1 starts any (a start moves its own channel as far as it can): then rank 1's
    # starts read both first collectives, and each rank's second reduce can be written only once rank 0 has read
    # rank 1's first reduce, which it does while it waits for a gather
    if rank == 1:
        dist.barrier()
    works = {name: [_start_sent(channel, seq, 16, rank) for seq in range(2)]
             for name, channel in (("gather", host.gather), ("reduce", host.reduce))}
    if rank == 0:
        dist.barrier()
    order = ("gather", "reduce") if rank == 0 else ("reduce", "gather")
    ok = True
    for name in order:
        for seq, work in enumerate(works[name]):
            ok = ok and work.wait(datetime.timedelta(seconds=20)) and _received_right(work.result, seq, world)
    return ok


def test_waits_on_different_channels_in_different_orders_on_different_ranks_complete():
    assert run_distributed(_rank_cross_channels, timeout_s=60) == [True, True]


def _rank_absent_peer() -> dict:
    rank = dist.get_rank()
    host = HostComm(None, 0, 64, reduce_slots=2)
    if rank == 1:  # never starts the collective
        dist.barrier()
        return {"rank": 1}
    work = host.reduce.start(4, lambda slot: slot.view(torch.float32).fill_(1.0), lambda rows: None)
    t0, cpu0 = time.monotonic(), time.process_time()
    completed = work.wait(datetime.timedelta(seconds=2))
    waited, cpu = time.monotonic() - t0, time.process_time() - cpu0
    dist.barrier()
    return {"rank": 0, "completed": completed, "waited": waited, "cpu": cpu, "default_timeout": host.timeout}


def test_a_wait_gives_up_at_its_timeout_when_a_rank_never_joins_without_burning_its_core():
    result = next(r for r in run_distributed(_rank_absent_peer, timeout_s=60) if r["rank"] == 0)
    assert result["completed"] is False
    assert 1.9 < result["waited"] < 30
    # spinning, or yielding a core nobody else wants, costs the whole wait in CPU time; sleeping costs little
    assert result["cpu"] < 0.25 * result["waited"], result
    # with no timeout of its own a wait takes the process group's (the harness sets 60 s), not a fixed default
    assert result["default_timeout"] == datetime.timedelta(seconds=60), result


def _rank_mismatch() -> str:
    """Rank 1 starts a collective of other bytes than rank 0's: both stop, naming both sides."""
    rank = dist.get_rank()
    channel = HostComm(None, 0, 4 * 64).reduce
    numel = 8 if rank == 0 else 12
    try:  # the start reads what it can at once: the mismatch may show there or in the wait
        channel.start(4 * numel, lambda slot: slot.view(torch.float32).fill_(1.0), lambda rows: None,
                      dtype=torch.float32, ident=3).wait(WAIT)
    except HostCommError as err:
        return str(err)
    return "completed"


def test_ranks_that_start_different_collectives_both_stop_with_an_error_naming_both():
    for message in run_distributed(_rank_mismatch, timeout_s=60):
        assert "started different collectives" in message or "failed" in message, message
        assert "32 bytes of float32 (id 3)" in message and "48 bytes of float32 (id 3)" in message, message


def _rank_peer_leaves(how: str) -> dict:
    """Rank 1 leaves after one collective (its process exits, or it closes its segments, or it posts a failure);
    rank 0's next collective must end with an error naming rank 1, within seconds."""
    rank = dist.get_rank()
    host = HostComm(None, 0, 4 * 64)
    assert _start_sent(host.reduce, 0, 4, rank).wait(WAIT)
    if rank == 1:
        if how == "closes":
            host.close()
        elif how == "fails":
            host.post_failure("compiling a graph failed (an injected error)")
        dist.barrier()
        return {"rank": 1}  # the harness ends this process at once: the lock on its segment goes with it
    dist.barrier()
    t0 = time.monotonic()
    try:
        _start_sent(host.reduce, 1, 4, rank).wait(WAIT)
        message = "completed"
    except HostCommError as err:
        message = str(err)
    return {"rank": 0, "message": message, "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("how, says", [("exits", "rank 1 exited"), ("closes", "rank 1 closed"),
                                       ("fails", "rank 1 failed: compiling a graph failed (an injected error)")])
def test_a_peer_that_exits_closes_or_fails_ends_the_wait_with_an_error_naming_it(how, says):
    result = next(r for r in run_distributed(_rank_peer_leaves, how, timeout_s=90) if r["rank"] == 0)
    assert says in result["message"], result
    assert result["seconds"] < 20, result  # the wait's own timeout is 60 s: the peer's state ended it


def _rank_sums(world_rows: bool) -> dict:
    """A bucket summed over the ranks through slots smaller than it (several chunks): into this rank's row of a
    (world, columns) bucket (ZeRO-3's reduce-scatter), or into the whole of a (1, columns) one (ZeRO-2's all-reduce);
    the result against gloo's all-reduce of the same values. ZeRO-3's also as its bucket's used columns, strided,
    divided by the world size on the way to the slots, the columns beyond untouched."""
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = HostComm(None, 0, 4 * 96, reduce_slots=2).reduce
    torch.manual_seed(rank)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        columns = torch.randn(world if world_rows else 1, 1000).to(dtype)
        expected = columns.clone()
        dist.all_reduce(expected)
        before = channel._next
        # waiting for the last chunk's collective waits for all of them
        assert start_sum(channel, columns, rank if world_rows else None).wait(WAIT)
        got = columns[rank] if world_rows else columns
        want = expected[rank] if world_rows else expected
        out[str(dtype)] = {"equal": torch.equal(got, want), "chunks": channel._next - before}
        if world_rows:  # ZeRO-3's bucket: its used columns where they lie (rows strided), pre-divided on the way
            bucket = torch.randn(world, 1300).to(dtype)
            columns, spare = bucket[:, :1000], bucket[:, 1000:].clone()
            expected = columns / world
            dist.all_reduce(expected)
            before = channel._next
            assert start_sum(channel, columns, rank, divisor=world).wait(WAIT)
            out[f"{dtype}, strided and divided"] = {"equal": torch.equal(columns[rank], expected[rank])
                                                    and torch.equal(bucket[:, 1000:], spare),
                                                    "chunks": channel._next - before}
    # an empty bucket (ZeRO-2 asks to reduce one) is one collective of no bytes, waited for like any other
    before = channel._next
    assert start_sum(channel, torch.empty(world if world_rows else 1, 0), rank if world_rows else None).wait(WAIT)
    return out, channel._next - before


def test_sums_over_two_ranks_are_gloos_bit_for_bit_chunk_by_chunk():
    for world_rows in (True, False):
        for r, empty_collectives in run_distributed(_rank_sums, world_rows, timeout_s=120):
            assert empty_collectives == 1
            for dtype, got in r.items():
                assert got["equal"], (world_rows, dtype)
                assert got["chunks"] > 4, (world_rows, dtype, got)  # more chunks than slots


def test_shm_where_it_cannot_be_used_is_an_error_naming_the_option_and_why():
    with pytest.raises(ValueError, match=r"compile.host_comm='shm' cannot be used: the runtime's device is meta"):
        open_host_comm("shm", None, torch.device("meta"), 64, 64)
    # auto: the process group instead, saying why
    meta = torch.device("meta")
    assert open_host_comm("auto", None, meta, 64, 64) == (None, "the runtime's device is meta, not cpu")
    assert open_host_comm("gloo", None, torch.device("cpu"), 64, 64) == (None, "compile.host_comm is 'gloo'")


def _mapped_segments() -> list:
    with open("/proc/self/maps") as f:
        return [line for line in f if "dsc_" in line]


def _rank_set_up(dirs: list, mode: str, reduce_bytes: int) -> dict:
    """``open_host_comm`` in this rank's directory of ``dirs``: what it returned or raised, what it left there."""
    directory = dirs[dist.get_rank() % len(dirs)]
    try:
        host, why = open_host_comm(mode, None, torch.device("cpu"), 0, reduce_bytes, directory=directory)
        outcome = "shm" if host is not None else "gloo"
        assert (why is None) == (host is not None), why
    except ValueError as err:
        host, outcome = None, f"ValueError: {err}"
    dist.barrier()  # every rank's set-up over (each unlinks its own file)
    out = {"outcome": outcome, "left": os.listdir(directory), "mapped_open": len(_mapped_segments())}
    if host is not None:  # a working set-up: closing returns everything
        host.close()
    out["mapped_closed"] = len(_mapped_segments())
    dist.barrier()
    return out


def test_ranks_that_share_a_host_but_not_a_directory_agree_to_use_the_process_group_and_leave_nothing():
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        for r in run_distributed(_rank_set_up, [a, b], "auto", 4096, timeout_s=60):
            assert r == {"outcome": "gloo", "left": [], "mapped_open": 0, "mapped_closed": 0}, r
        for r in run_distributed(_rank_set_up, [a, b], "shm", 4096, timeout_s=60):
            assert r["outcome"].startswith("ValueError: compile.host_comm='shm' cannot be used: setting up its "
                                           "segments failed on rank "), r
            assert "No such file" in r["outcome"] or "not the segment" in r["outcome"], r
            assert r["left"] == [] and r["mapped_open"] == 0, r


def test_a_shared_directory_works_and_closing_returns_everything():
    with tempfile.TemporaryDirectory() as a:
        for r in run_distributed(_rank_set_up, [a], "shm", 4096, timeout_s=60):
            assert r == {"outcome": "shm", "left": [], "mapped_open": 2, "mapped_closed": 0}, r


def _auto_in_an_engine() -> dict:
    """What ``compile.host_comm`` "auto" (the default) chose in a compiled engine on this machine, and why not shared
    memory where it did not."""
    from deepspeed.compile.report import engine_report
    from models import ds_config
    from training import make_engine, train
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True}))
    train(engine, "gpt", 1, compile_kwargs={"backend": "eager"})
    report = engine_report(engine)
    engine.destroy()
    return {"host_comm": report["host_comm"], "reason": report["host_comm_reason"]}


def test_auto_takes_shared_memory_on_this_machine():
    """The guard behind every test that expects shared memory of "auto" (``machine.expected_transport``): a compiled
    engine at the default setting took it here, in ``/dev/shm``. Under CI it must, whatever this machine is: a CI run
    whose ranks talk through the process group fails here, with the product's reason, instead of testing gloo twice.
    Elsewhere it skips where the machine offers no shared memory (``machine.shared_memory_missing``)."""
    from machine import expected_transport, require_shared_memory
    require_shared_memory()
    assert expected_transport("auto") == "shm"
    for r in run_distributed(_auto_in_an_engine, timeout_s=120):
        assert r["host_comm"] == "shm", f"compile.host_comm 'auto' chose {r['host_comm']} here: {r['reason']}"
        assert r["reason"] is None, r


def _small_tmpfs(mib: int):
    """A tmpfs of ``mib`` MiB mounted on a new directory (a container's small /dev/shm). Where this process may not
    mount one (it needs root; CI runs as root), the test fails under CI and skips elsewhere
    (``machine.unavailable_here``)."""
    directory = tempfile.mkdtemp()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", directory], capture_output=True,
                          text=True)
    if done.returncode != 0:
        os.rmdir(directory)
        unavailable_here("tmpfs", done.stderr.strip())
    return directory


@pytest.mark.parametrize("mib", [1, 6])
def test_a_directory_too_small_for_the_segments_is_agreed_at_set_up_not_a_crash_later(mib):
    """A segment of just over 4 MiB a rank (4 reduce slots of 1 MiB) in 1 MiB (too small for any rank) or in 6 MiB
    (enough free space for each rank alone, not for both: the space must be reserved, not only checked). A lazily
    backed file would set up fine and die of SIGBUS at its first write."""
    directory = _small_tmpfs(mib)
    try:
        for r in run_distributed(_rank_set_up, [directory], "auto", 1 << 20, timeout_s=60):
            assert r == {"outcome": "gloo", "left": [], "mapped_open": 0, "mapped_closed": 0}, r
        for r in run_distributed(_rank_set_up, [directory], "shm", 1 << 20, timeout_s=60):
            assert "No space left" in r["outcome"] or "MiB free" in r["outcome"], r
    finally:
        subprocess.run(["umount", directory], check=True)
        os.rmdir(directory)
