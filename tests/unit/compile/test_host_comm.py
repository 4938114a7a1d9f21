"""Collectives through shared memory between the ranks of one host (``runtime/host_comm.py``): every rank reads what
every rank sent, in any order of waits, with more collectives in flight than slots, and a rank that never joins makes
the wait give up at its timeout instead of hanging."""
import datetime
import random

import torch
import torch.distributed as dist

from deepspeed.compile.runtime.host_comm import Channel, new_token
from distributed import run_distributed


def _sent(seq: int, rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + 1000.0 * seq + 0.5 * rank


def _rank_channel(slots: int, count: int, seed: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = Channel(None, rank, world, 4 * 64, slots, new_token(None), "t")
    rng = random.Random(seed)  # the same choices on every rank: the same collectives in the same order
    started, results, waits = [], {}, []
    for seq in range(count):
        numel = rng.randint(1, 64)
        data = _sent(seq, rank, numel)
        started.append((seq, numel, channel.start(4 * numel, lambda slot, d=data: slot.view(torch.float32).copy_(d),
                                                  lambda rows: [r.view(torch.float32).clone() for r in rows])))
        # wait for a random one of those started, sometimes none, sometimes several
        while started and rng.random() < 0.4:
            seq_done, numel_done, work = started.pop(rng.randrange(len(started)))
            assert work.wait(datetime.timedelta(seconds=60))
            results[seq_done] = work.result
            waits.append(seq_done)
    for seq, numel, work in started:
        assert work.wait(datetime.timedelta(seconds=60))
        results[seq] = work.result
    ok = all(torch.equal(results[seq][r], _sent(seq, r, results[seq][r].numel())) for seq in results
             for r in range(world))
    return {"ok": ok, "count": len(results), "out_of_order": waits != sorted(waits), "max_open": count}


def test_every_rank_reads_what_every_rank_sent_in_any_order_with_more_in_flight_than_slots():
    for r in run_distributed(_rank_channel, 3, 60, 7, timeout_s=120):
        assert r["ok"] and r["count"] == 60
        assert r["out_of_order"]  # the waits did not simply follow the starts


def _rank_absent_peer() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = Channel(None, rank, world, 64, 2, new_token(None), "t")
    if rank == 1:  # never starts the collective
        dist.barrier()
        return {"rank": 1}
    work = channel.start(4, lambda slot: slot.view(torch.float32).fill_(1.0), lambda rows: None)
    t0 = datetime.datetime.now()
    completed = work.wait(datetime.timedelta(seconds=0.5))
    waited = (datetime.datetime.now() - t0).total_seconds()
    dist.barrier()
    return {"rank": 0, "completed": completed, "waited": waited}


def test_a_wait_gives_up_at_its_timeout_when_a_rank_never_joins():
    result = next(r for r in run_distributed(_rank_absent_peer, timeout_s=60) if r["rank"] == 0)
    assert result["completed"] is False
    assert 0.4 < result["waited"] < 10


def _rank_sums(world_rows: bool) -> dict:
    """A bucket summed over the ranks through slots smaller than it (several chunks): into this rank's row of a
    (world, columns) bucket (ZeRO-3's reduce-scatter), or into the whole of a (1, columns) one (ZeRO-2's all-reduce);
    the result against gloo's all-reduce of the same values."""
    from deepspeed.compile.runtime.host_comm import start_sum
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = Channel(None, rank, world, 4 * 96, 2, new_token(None), "t")
    torch.manual_seed(rank)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        columns = torch.randn(world if world_rows else 1, 1000).to(dtype)
        expected = columns.clone()
        dist.all_reduce(expected)
        before = channel._next
        # waiting for the last chunk's collective waits for all of them
        assert start_sum(channel, columns, rank if world_rows else None).wait(datetime.timedelta(seconds=60))
        got = columns[rank] if world_rows else columns
        want = expected[rank] if world_rows else expected
        out[str(dtype)] = {"equal": torch.equal(got, want), "chunks": channel._next - before}
    # an empty bucket (ZeRO-2 asks to reduce one) is one collective of no bytes, waited for like any other
    before = channel._next
    assert start_sum(channel, torch.empty(world if world_rows else 1, 0), rank if world_rows else None).wait(
        datetime.timedelta(seconds=60))
    return out, channel._next - before


def test_sums_over_two_ranks_are_gloos_bit_for_bit_chunk_by_chunk():
    for world_rows in (True, False):
        for r, empty_collectives in run_distributed(_rank_sums, world_rows, timeout_s=120):
            assert empty_collectives == 1
            for dtype, got in r.items():
                assert got["equal"], (world_rows, dtype)
                assert got["chunks"] > 4, (world_rows, dtype, got)  # more chunks than slots


def test_shm_where_it_cannot_be_used_is_an_error_naming_the_option_and_why():
    import pytest
    from deepspeed.compile.runtime.host_comm import open_host_comm
    with pytest.raises(ValueError, match=r"compile.host_comm='shm' cannot be used: the runtime's device is meta"):
        open_host_comm("shm", None, torch.device("meta"), 64, 64)
    assert open_host_comm("auto", None, torch.device("meta"), 64, 64) is None  # auto: the process group instead
    assert open_host_comm("gloo", None, torch.device("cpu"), 64, 64) is None
