# SPDX-License-Identifier: Apache-2.0
"""Where a row's optimizer step goes: ``cProfile`` around ``engine.step()`` of one step after warm-up, rank 0.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/optimizer_profile.py \
        --row ours-mincut --model gpt2 --size 355m [--zero-settings defaults] [--steps 4] [--lines 30] [--values]

Builds the row as ``worker.py`` does (same model, config and batches), runs ``--steps`` steps printing each phase's
seconds (the optimizer's with the process's CPU time, page faults and context switches in it), and profiles the last
step's ``engine.step()``: the functions by cumulative time. One row per launch, so a
355M model fits in memory; run it for ``zero3`` too and compare. ``--values`` also prints, after the last step, what
the values the optimizer reads are: per kind of tensor (its parameters, their gradients, each state entry) the
elements, the subnormal ones (arithmetic on them takes a slow path on x86 unless the CPU flushes them), the
non-finite ones, and whether this process flushes subnormals to zero. ``--threads`` prints, for the last step's
``engine.step()``, the CPU seconds each thread of the process spent in it (by the OS's thread name): where a step's
wall time exceeds its main thread's CPU time, who else ran. ``--alone`` then times Adam's arithmetic once more on each
rank in turn while the other waits: on fresh tensors of the partition's size, and reading the optimizer's own
tensors (an out-of-place sqrt of its second moment), then on both ranks at once (a quarter of the size): whether the
process's state or its neighbour makes it slow. ``--fresh N`` writes N new tensors of the partition's size, one after
another, right before each step's ``engine.step()``, and prints how long each took: what memory the OS hands out
costs at that moment, and, as the last of them was just freed, the step run on pages the process touched a moment
ago. ``--sub-group-size N`` sets ZeRO-3's ``sub_group_size`` (DeepSpeed's default 1e9 puts a model under 1e9
elements in one flat partition, which Adam steps on in one piece). ``--ops`` prints the last step's ``engine.step()``
by torch operator (``torch.profiler``, CPU time, rank 0). ``--malloc`` prints, at each phase's end, rank 0's
resident memory beside what glibc's allocator holds (``mallinfo2``: its heaps, the free bytes in them, its mapped
blocks): how much of the process's RSS is memory the allocator keeps after it was freed. Each step's line splits the
optimizer phase's CPU time into user and system time; ``--perf FILE`` samples rank 0's last ``engine.step()`` with
``perf record -g`` (``perf report -i FILE --stdio --no-children --sort sym``): where the kernel's share goes, the
zeroing of new pages included.
"""
import argparse
import cProfile
import ctypes
import io
import os
import pstats
import resource
import shutil
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import worker  # noqa: E402  (sets up the checkout's deepspeed.compile)
from benchmarks.models import make_batch, make_model, size_arg  # noqa: E402


def start_perf(path: str) -> subprocess.Popen:
    """``perf record -g`` attached to this process, writing ``path``; stopped with SIGINT by the caller."""
    recorder = subprocess.Popen(["perf", "record", "-g", "-p", str(os.getpid()), "-o", path],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches asynchronously: the step must not start before it samples
    return recorder


def time_alone(optimizer: torch.optim.Optimizer, rank: int) -> None:
    """One Adam update's arithmetic (``torch.optim.adam._single_tensor_adam``'s in-place ops) on fresh tensors of the
    partition's size, and a sqrt reading the optimizer's own second moment, timed on each rank while the other
    waits in a barrier."""
    state = next(iter(optimizer.state.values()))
    real = state["exp_avg_sq"]
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn != rank:
            continue
        param, grad, exp_avg, exp_avg_sq = (torch.rand_like(real) for _ in range(4))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            exp_avg.lerp_(grad, 0.1)
            exp_avg_sq.mul_(0.999).addcmul_(grad, grad, value=0.001)
            denom = (exp_avg_sq.sqrt() / 0.5).add_(1e-8)
            param.addcdiv_(exp_avg, denom, value=-1e-3)
            del denom
            times.append(time.perf_counter() - start)
        del param, grad, exp_avg, exp_avg_sq  # before the other rank allocates its own: at 355M memory is tight
        start = time.perf_counter()
        root = real.sqrt()
        real_sqrt = time.perf_counter() - start
        del root
        faults = []
        for _ in range(3):  # a new tensor of the partition's size written once: its pages faulted in, then freed
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            torch.empty_like(real).fill_(1.0)
            faults.append((time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
        with open("/proc/self/maps") as f:
            mappings = sum(1 for _ in f)
        print(f"rank {rank} alone: a new tensor of the partition's size written once "
              f"{', '.join(f'{t:.2f} s ({n} faults)' for t, n in faults)}; {mappings} mappings", flush=True)
        print(f"rank {rank} alone: Adam's arithmetic on fresh tensors of {real.numel()} elements "
              f"{', '.join(f'{t:.2f}' for t in times)} s; a sqrt of the optimizer's own second moment "
              f"{real_sqrt:.2f} s (its data_ptr % 4096 = {real.data_ptr() % 4096})", flush=True)
    # then both ranks at once, on a quarter of the partition's size each (two full sets would not fit at 355M)
    dist.barrier()
    param, grad, exp_avg, exp_avg_sq = (torch.rand(real.numel() // 4) for _ in range(4))
    together = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        exp_avg.lerp_(grad, 0.1)
        exp_avg_sq.mul_(0.999).addcmul_(grad, grad, value=0.001)
        param.addcdiv_(exp_avg, (exp_avg_sq.sqrt() / 0.5).add_(1e-8), value=-1e-3)
        together.append(time.perf_counter() - start)
    print(f"rank {rank} together: Adam's arithmetic on fresh tensors of {param.numel()} elements, both ranks at "
          f"once: {', '.join(f'{t:.2f}' for t in together)} s", flush=True)
    del param, grad, exp_avg, exp_avg_sq
    dist.barrier()


def write_fresh(count: int, numel: int) -> list:
    """Seconds to write each of ``count`` new fp32 tensors of ``numel`` elements, each freed before the next."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        torch.empty(numel).fill_(1.0)
        times.append(time.perf_counter() - start)
    return times


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_line() -> str:
    """This process's resident and peak resident memory, and glibc's heaps, their free bytes and its mapped blocks
    (MiB); what the heaps hold free stays resident until the allocator reuses or trims it."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    rss, hwm = (int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    mib = 1 << 20
    return (f"RSS {rss:.0f} MiB (peak {hwm:.0f}); glibc heaps {info.arena / mib:.0f} MiB, free in them "
            f"{info.fordblks / mib:.0f} MiB, mapped blocks {info.hblkhd / mib:.0f} MiB in {info.hblks}")


def thread_cpu() -> dict:
    """CPU seconds (user + system) so far of each OS thread of this process: (tid, name) -> seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        found[(int(tid), name)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return found


def print_values(optimizer: torch.optim.Optimizer) -> None:
    """Subnormal and non-finite elements of what ``optimizer`` (the torch optimizer inside ZeRO's) reads."""
    kinds = {}
    # by the state's keys: ZeRO-3 empties its param groups' parameter lists after each step
    params = list(optimizer.state) or [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        tensors = {"param": param, "grad": param.grad, **optimizer.state.get(param, {})}
        for kind, tensor in tensors.items():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel() > 1:
                flat = tensor.detach().reshape(-1)
                subnormal = ((flat != 0) & (flat.abs() < torch.finfo(flat.dtype).tiny)).sum().item()
                counts = kinds.setdefault(kind, [0, 0, 0])
                counts[0] += flat.numel()
                counts[1] += subnormal
                counts[2] += (~torch.isfinite(flat)).sum().item()
    for param, state in optimizer.state.items():  # how each tensor the update reads is laid out
        for kind, tensor in {"param": param, **state}.items():
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 1:
                print(f"{kind}: {tensor.dtype}, {tuple(tensor.shape)}, contiguous {tensor.is_contiguous()}, "
                      f"storage {tensor.untyped_storage().nbytes()} bytes for "
                      f"{tensor.numel() * tensor.element_size()}, offset {tensor.storage_offset()}, "
                      f"data_ptr % 64 = {tensor.data_ptr() % 64}")
    flushed = (torch.tensor([1e-39]) * 1.0).item() == 0
    print(f"subnormals flushed to zero in this process: {flushed}")
    for kind, (numel, subnormal, nonfinite) in kinds.items():
        print(f"{kind}: {numel} elements, {subnormal} subnormal, {nonfinite} not finite")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", default="ours-mincut", help="a DeepSpeed row of worker.py (zero3, ours-mincut, ...)")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--size", type=size_arg, default="124m")
    p.add_argument("--zero-settings", default="defaults")
    p.add_argument("--dtype", default="fp32", help="as worker.py's --dtype (fp32, bf16, autocast)")
    p.add_argument("--backend", default="eager", help="as worker.py's --backend, for the DeepCompile rows")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lines", type=int, default=30)
    p.add_argument("--threads", action="store_true", help="the CPU time of each thread of the process over the last "
                   "step's engine.step()")
    p.add_argument("--alone", action="store_true", help="after the steps, time Adam's arithmetic on each rank while "
                   "the other waits")
    p.add_argument("--values", action="store_true", help="after the steps, count subnormal and non-finite values in "
                   "what the optimizer reads")
    p.add_argument("--fresh", type=worker.elements, default=0,
                   help="write this many new partition-sized tensors right before each engine.step(), timed")
    p.add_argument("--ops", action="store_true", help="the last step's engine.step() by torch operator")
    p.add_argument("--perf", default="", metavar="FILE", help="rank 0's last engine.step() sampled by `perf record "
                   "-g` into FILE (then `perf report -i FILE --stdio`): where its CPU time goes, the kernel's included")
    p.add_argument("--malloc", action="store_true", help="rank 0's RSS and glibc's heaps at each phase's end")
    p.add_argument("--sub-group-size", type=worker.elements, default=0,
                   help="ZeRO-3's sub_group_size (default: DeepSpeed's)")
    p.add_argument("--adam", choices=("torch", "deepspeed"), default="torch", help="as run.py's --adam")
    args = p.parse_args()
    row_args = worker.parse_args(["--row", args.row, "--model", args.model, "--size", args.size, "--dtype", args.dtype,
                                  "--backend", args.backend,
                                  "--zero-settings", args.zero_settings, "--sub-group-size", str(args.sub_group_size),
                                  "--adam", args.adam])
    if args.perf and shutil.which("perf") is None:
        p.error("--perf: Linux's perf is not on PATH (install linux-perf or linux-tools)")
    if args.row.startswith("fsdp2") or args.row == "local":
        p.error("--row: a DeepSpeed row (the optimizer step profiled is engine.step())")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    (forward, backward, optimizer_step), engine = worker.build_deepspeed(row_args,
                                                                         make_model(args.model, args.size, 0))
    profile = cProfile.Profile()
    # the largest tensor ZeRO-3's optimizer steps on: its flat fp32 partition (ZeRO-1/2 rows have none: no --fresh)
    partition = max(t.numel() for t in engine.optimizer.fp32_partitioned_groups_flat) if args.fresh else 0
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = forward(make_batch(args.size, step, rank))
        t1 = time.perf_counter()
        if args.malloc and rank == 0:
            print(f"step {step}, after forward: {malloc_line()}", flush=True)
        backward(loss)
        t2 = time.perf_counter()
        if args.malloc and rank == 0:
            print(f"step {step}, after backward: {malloc_line()}", flush=True)
        last = step == args.steps - 1
        if last:
            profile.enable()
        if last and args.values and rank == 0:
            grads = [g for group in getattr(engine.optimizer, "averaged_gradients", {}).values() for g in group]
            storages = {g.untyped_storage().data_ptr() for g in grads}
            print(f"before the last step: {len(grads)} gradient partitions in {len(storages)} storages, dtypes "
                  f"{sorted({str(g.dtype) for g in grads})}, all contiguous {all(g.is_contiguous() for g in grads)}")
        fresh = write_fresh(args.fresh, partition)
        threads = thread_cpu() if last and args.threads else {}
        recorder, attach = None, time.perf_counter()
        if last and args.perf and rank == 0:
            recorder = start_perf(args.perf)
            t2 += time.perf_counter() - attach  # the optimizer phase printed leaves perf's attach out
        before, cpu = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        if last and args.ops:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ops:
                optimizer_step()
            if rank == 0:
                print(ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.lines or 15))
        else:
            optimizer_step()
        after, cpu = resource.getrusage(resource.RUSAGE_SELF), time.process_time() - cpu
        if recorder is not None:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=60)
        if threads:
            spent = {key: seconds - threads.get(key, 0.0) for key, seconds in thread_cpu().items()}
            print(f"rank {rank}, threads: {len(spent)}; CPU seconds in engine.step() by thread: " + ", ".join(
                f"{name} ({tid}) {seconds:.2f}" for (tid, name), seconds in sorted(spent.items(), key=lambda kv: -kv[1])
                if seconds > 0), flush=True)
        if last:
            profile.disable()
        if fresh:
            print(f"rank {rank}, step {step}: {len(fresh)} new tensors of {partition} elements written before "
                  f"engine.step(): {', '.join(f'{t:.2f}' for t in fresh)} s", flush=True)
        if args.malloc and rank == 0:
            print(f"step {step}, after the optimizer: {malloc_line()}", flush=True)
        if rank == 0:
            with open("/proc/self/maps") as f:
                mappings = sum(1 for _ in f)
            optimizer_s = time.perf_counter() - t2 - sum(fresh)
            print(f"step {step}: {mappings} mappings; forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s, optimizer "
                  f"{optimizer_s:.2f} s (CPU {cpu:.2f} s: user {after.ru_utime - before.ru_utime:.2f}, system "
                  f"{after.ru_stime - before.ru_stime:.2f}; page faults {after.ru_minflt - before.ru_minflt}"
                  f" minor {after.ru_majflt - before.ru_majflt} major, context switches "
                  f"{after.ru_nvcsw - before.ru_nvcsw} voluntary {after.ru_nivcsw - before.ru_nivcsw} involuntary)",
                  flush=True)
    if args.alone:
        time_alone(engine.optimizer.optimizer, rank)
    if rank == 0 and args.values:
        print_values(engine.optimizer.optimizer)
    if rank == 0:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.lines)
        print(out.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
