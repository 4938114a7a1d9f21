# SPDX-License-Identifier: Apache-2.0
"""One benchmark configuration on the ranks of one launch (torchrun or the deepspeed launcher).

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/worker.py \
        --row ours-mincut --backend eager --dtype fp32 --model gpt --out result.json

Trains ``1 + warmup + steps + 2`` steps on the same model, data and seeds for every row: the first step is
timed as the compile step, ``steps`` are timed (their median is the step time) with collectives counted, the
last two run under the memory profiler (the first of them warms the trace and reads saved-for-backward bytes;
the second is the measured step). Rank 0 writes the result as JSON.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from benchmarks.checkout import use_checkout  # noqa: E402

use_checkout()  # the checkout's deepspeed.compile, before deepspeed is imported

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import compile_profile  # noqa: E402
from benchmarks.comm import count_collectives  # noqa: E402
from benchmarks.memory import live_at_peak, live_tensor_bytes, mark, step_peak, trace_memory  # noqa: E402
from benchmarks.models import SIZES, blocks, make_batch, make_model, parameter_count, size_arg, size_of  # noqa: E402
from benchmarks.saved import saved_bytes  # noqa: E402

ROWS = ("zero3", "zero3+compile", "ours-mincut", "ours-mincut-gloo", "ours-mincut+keep", "ours-regather",
        "ours-mincut-heap", "ours-blocks", "ours-blocks-gloo", "ours-default", "fsdp2", "fsdp2+compile", "zero1",
        "ours-zero1", "zero2", "zero2+compile", "ours-zero2", "ours-zero2-default", "local")
EAGER_ROWS = ("zero3", "zero1", "zero2", "fsdp2", "local")  # rows that compile nothing
# what a DeepCompile row sets in the "compile" section besides deepcompile and the min-cut partitioner
ROW_SECTIONS = {
    "ours-default": {"partitioner": "default"},
    "ours-mincut-gloo": {"host_comm": "gloo"},  # the process group as the transport, where the default is shm
    "ours-mincut+keep": {"keep_gathered_bytes": "prefetch"},  # about what backward's first run would gather again
    "ours-regather": {"keep_gathered_bytes": 0},  # whatever stage3_max_reuse_distance says
    "ours-mincut-heap": {"release_host_memory": False},  # the allocator keeps what the step freed (host_memory.py)
    "ours-blocks": {"regions": "blocks"},  # one compiled graph serves every block (driver/regions.py)
    "ours-blocks-gloo": {"regions": "blocks", "host_comm": "gloo"},  # block by block on the process group
    "ours-zero2-default": {"partitioner": "default"},  # ZeRO-2 with AOTAutograd's default partition
}
DTYPES = ("fp32", "bf16", "autocast")
LR = 1e-3
CLIP = 1.0  # DeepSpeed 0.19.8 clips at norm 1.0 by default; FSDP2 is clipped the same way

Step = Tuple[Callable[[Tuple[torch.Tensor, ...]], torch.Tensor], Callable[[torch.Tensor], None], Callable[[], None]]


def ds_config(dtype: str, model_numel: int, batch: int, compile_section: Optional[Dict[str, Any]],
              zero_settings: str = "tuned", stage: int = 3, hidden: int = 0, adam: str = "torch") -> Dict[str, Any]:
    """One ZeRO config for every DeepSpeed row (stage 3 unless ``stage``). ``tuned``: buckets sized to the model
    (reduce a quarter of it, prefetch an eighth), nothing persistent.
    ``defaults``: the ZeRO section says only the stage, as most users' configs do (DeepSpeed's 5e8-element
    buckets, parameters under 1e5 elements persistent). ``offload``: the defaults with ZeRO-3's parameter shards and
    optimizer on the CPU (``offload_param`` and ``offload_optimizer``, as Hugging Face's "zero3 offload" config).
    ``hf-auto``: Hugging Face's ZeRO-2 / ZeRO-3 example configs with their "auto" values filled in as its Trainer
    fills them from the model's ``hidden`` size (buckets of about one hidden x hidden weight, parameters under
    10 x hidden elements persistent, reuse distance and live parameters 1e9, ``overlap_comm``), offload left off.
    ``adam``: AdamW as torch's (``"torch_adam": true``) or, ``"deepspeed"``, as a section naming only AdamW gets it
    (DeepSpeed's FusedAdam, on CPU its C++ kernel)."""
    bucket = int(max(model_numel // 4, 1 << 16))
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, **({"torch_adam": True} if adam == "torch" else {})}},
        # prefetch: about one block of the large Llama ahead (an eighth of the model), for every DeepSpeed row
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                              "stage3_prefetch_bucket_size": bucket // 2, "stage3_max_live_parameters": bucket,
                              "stage3_max_reuse_distance": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    if zero_settings == "defaults":
        config["zero_optimization"] = {"stage": stage}
    elif zero_settings == "offload":
        if stage != 3:
            raise ValueError("--zero-settings offload: parameter offload is ZeRO-3's; choose ZeRO-3 rows")
        config["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"},
                                       "offload_optimizer": {"device": "cpu"}}
    elif zero_settings == "hf-auto":
        if hidden <= 0:
            raise ValueError("--zero-settings hf-auto: the model's hidden size is needed for its auto values")
        config["zero_optimization"] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                       "reduce_bucket_size": hidden * hidden}
        if stage != 3:  # its ZeRO-2 example config
            config["zero_optimization"].update({"allgather_partitions": True, "allgather_bucket_size": int(2e8),
                                                "reduce_scatter": True})
        else:
            config["zero_optimization"].update({
                "sub_group_size": int(1e9), "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                "stage3_param_persistence_threshold": 10 * hidden, "stage3_max_live_parameters": int(1e9),
                "stage3_max_reuse_distance": int(1e9)})
    elif stage != 3:  # ZeRO-1/2 read the reduce and all-gather buckets only
        config["zero_optimization"] = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    elif zero_settings != "tuned":
        raise ValueError(f"zero_settings must be 'tuned', 'defaults', 'offload' or 'hf-auto', got {zero_settings!r}")
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if compile_section is not None:
        config["compile"] = compile_section
    return config


def build_deepspeed(args: argparse.Namespace, model: torch.nn.Module) -> Tuple[Step, Any]:
    import deepspeed
    section = None
    if args.row.startswith("ours-"):
        section = {"deepcompile": True, "partitioner": "min_cut", **ROW_SECTIONS.get(args.row, {})}
    stage = 1 if "zero1" in args.row else 2 if "zero2" in args.row else 3
    config = ds_config(args.dtype, parameter_count(model), size_of(args.size).batch, section, args.zero_settings,
                       stage, hidden=size_of(args.size).dim, adam=args.adam)
    if args.sub_group_size:
        config["zero_optimization"]["sub_group_size"] = args.sub_group_size
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    if args.row not in EAGER_ROWS:
        engine.compile(backend=args.backend)
    return (lambda batch: engine(*batch), engine.backward, engine.step), engine


def build_fsdp2(args: argparse.Namespace, model: torch.nn.Module) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    autocast = args.dtype == "autocast" and args.fsdp2_autocast == "torch"  # else FSDP2's own mixed precision
    if args.dtype == "autocast" and not autocast:  # bf16 parameters and compute, fp32 gradient reduction
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif args.dtype == "bf16":  # bf16 compute and reduction over fp32 master weights, as DeepSpeed's bf16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = torch.compile(model, backend=args.backend) if args.row == "fsdp2+compile" else model
    # torch.autocast over fp32 parameters: the numerics of DeepSpeed's torch_autocast (norms, softmax and the
    # residual stream stay fp32), where FSDP2's policy computes everything in bf16
    return _torch_step(model, compiled, optimizer, autocast)


def _torch_step(model: torch.nn.Module, run: Callable, optimizer: torch.optim.Optimizer, autocast: bool) -> Step:
    """A plain PyTorch training step: ``run(*batch)`` (under bf16 ``torch.autocast`` if asked), ``loss.backward()``,
    then clipping at ``CLIP``, the optimizer's step and every gradient dropped."""
    def forward(batch: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return run(*batch)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        model.zero_grad(set_to_none=True)

    return (forward, lambda loss: loss.backward(), step)


def build_local(args: argparse.Namespace, model: torch.nn.Module) -> Step:
    """The compute floor: every rank trains a full replica of the model on its own batch, with no collective at all,
    and steps AdamW over its own share of the parameters (half of them by size on 2 ranks, as a ZeRO rank's optimizer
    steps its partition). The arithmetic each rank does in a sharded step, without sharding's communication, copies
    and bookkeeping: no sharded configuration can be faster with the same kernels. Its losses are not averaged
    across ranks, so they are not checked against the others'."""
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)  # bf16 compute and optimizer state (a floor: no fp32 master weights)
    rank, world = dist.get_rank(), dist.get_world_size()
    loads = [0] * world
    mine = []
    for p in sorted(model.parameters(), key=lambda p: -p.numel()):  # largest first, each to the least loaded rank
        owner = loads.index(min(loads))
        loads[owner] += p.numel()
        if owner == rank:
            mine.append(p)
    return _torch_step(model, model, torch.optim.AdamW(mine, lr=LR), args.dtype == "autocast")


PHASES = ("forward", "backward", "optimizer")


def train_step(fns: Step, batch: Tuple[torch.Tensor, ...], walk: bool = False,
               phase_times: Optional[Dict[str, List[float]]] = None) -> Tuple[float, Optional[Tuple]]:
    """One step; with ``phase_times``, each phase's seconds are appended to its list."""
    forward, backward, optimizer_step = fns
    saved = None
    clock = [time.perf_counter()]

    def lap(phase: str) -> None:
        clock.append(time.perf_counter())
        if phase_times is not None:
            phase_times[phase].append(clock[-1] - clock[-2])

    with mark("step"):
        with mark("forward"):
            loss = forward(batch)
        lap("forward")
        if walk:
            saved = saved_bytes(loss)
            clock[-1] = time.perf_counter()
        with mark("backward"):
            backward(loss)
        lap("backward")
        with mark("optimizer"):
            optimizer_step()
        lap("optimizer")
    return loss.item(), saved


def _downsample(times: List[float], values: List[int], limit: int = 4000) -> Tuple[List[float], List[int]]:
    """Keep every local extremum of a long curve in ``limit`` buckets (the peak is never dropped)."""
    if len(times) <= limit:
        return times, values
    out_t, out_v, width = [], [], len(times) / (limit / 2)
    for i in range(int(limit / 2)):
        lo, hi = int(i * width), max(int((i + 1) * width), int(i * width) + 1)
        seg = range(lo, min(hi, len(times)))
        for j in sorted({min(seg, key=values.__getitem__), max(seg, key=values.__getitem__)}):
            out_t.append(times[j])
            out_v.append(values[j])
    return out_t, out_v


def run(args: argparse.Namespace) -> Dict[str, Any]:
    rank = dist.get_rank()
    # torch's partitioner option, for every compiled row alike (ours partitions with torch's min-cut too)
    import torch._functorch.config as functorch_config
    functorch_config.activation_memory_budget = args.activation_memory_budget
    model = make_model(args.model, args.size, args.seed)
    n_params = parameter_count(model)
    engine = None
    if args.row.startswith("fsdp2"):
        fns = build_fsdp2(args, model)
    elif args.row == "local":
        fns = build_local(args, model)
    else:
        fns, engine = build_deepspeed(args, model)
    ours_row = args.row.startswith("ours-")
    if ours_row:
        from deepspeed.compile import report
    batches = [make_batch(args.size, i, rank) for i in range(1 + args.warmup + args.steps + 2)]
    losses, times = [], []
    phase_times: Dict[str, List[float]] = {phase: [] for phase in PHASES}  # the timed steps'

    def timed(i: int, walk: bool = False, phases: bool = False) -> Optional[Tuple]:
        t0 = time.perf_counter()
        loss, saved = train_step(fns, batches[i], walk, phase_times if phases else None)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if args.progress and rank == 0:
            print(f"[{args.row}/{args.backend}/{args.dtype}] step {i:3d}  loss {loss:.5f}  "
                  f"time {times[-1]:.3f} s", flush=True)
        return saved

    timed(0)
    compile_timers = compile_profile.record()  # step 0 compiled everything (benchmarks/compile_profile.py)
    for i in range(1, 1 + args.warmup):
        timed(i)
    if ours_row:
        report.reset_counters(engine)
    with count_collectives() as counts:
        for i in range(1 + args.warmup, 1 + args.warmup + args.steps):
            timed(i, phases=True)
    ours = report.engine_report(engine) if ours_row else None  # None if the engine fell back to eager ZeRO-3
    # the most resident memory any rank reached so far (building the model, compiling, training), before the
    # memory profiler's steps below add their own
    peak_rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(peak_rss, op=dist.ReduceOp.MAX)
    persistent = live_tensor_bytes()
    with trace_memory() as traced:
        saved = timed(len(times), walk=True)
        if ours_row:
            report.record_gathered_timeline(engine, True)
        gathered_t0 = time.perf_counter()
        timed(len(times))
    gathered = report.gathered_timeline(engine) if ours_row else None
    spans = report.collective_spans(engine) if ours_row else None
    timeline = step_peak(traced["timeline"], "step")
    peak_above = timeline.peak_bytes if timeline is not None else None
    at_peak = live_at_peak(traced["timeline"], "step")

    mean_loss = torch.tensor([losses[-1]], dtype=torch.float64)
    dist.all_reduce(mean_loss)
    result: Dict[str, Any] = {
        "row": args.row, "backend": args.backend if args.row not in EAGER_ROWS else "-",
        "dtype": args.dtype, "model": args.model, "size": args.size, "world_size": dist.get_world_size(),
        "params": n_params,
        "first_step_s": times[0], "step_times_s": times[1 + args.warmup:1 + args.warmup + args.steps],
        "median_step_s": statistics.median(times[1 + args.warmup:1 + args.warmup + args.steps]),
        # rank 0's median seconds per phase of the timed steps (a phase's median, so they need not add up)
        "phase_medians_s": {phase: statistics.median(v) for phase, v in phase_times.items()},
        "losses": losses, "final_loss": mean_loss.item() / dist.get_world_size(),
        "peak_above_start_bytes": peak_above, "persistent_bytes": persistent,
        "peak_bytes": None if peak_above is None else persistent + peak_above, "peak_rss_bytes": peak_rss.item(),
        "saved_param_bytes": saved[0], "saved_other_bytes": saved[1], "saved_source": "autograd-walk",
        "allgather_bytes_per_step": counts.allgather_bytes / args.steps,
        "reduce_scatter_bytes_per_step": counts.reduce_scatter_bytes / args.steps,
        "comm_source": "torch.distributed", "peak_gathered_bytes": None, "report": ours,
        "compile_timers": compile_timers,
        # what was live at that peak, by what allocated it: [allocated by, bytes, blocks] (benchmarks/memory.py)
        "live_at_peak": at_peak,
    }
    if ours is not None:  # seconds per timed step the ranks waited on collectives (exposed communication)
        result["wait_per_step_s"] = {"gather": ours.get("gather_seconds", 0.0) / args.steps,
                                     "reduce": ours["reduce_wait_seconds"] / args.steps}
    if ours is not None and ours["zero_stage"] == 3:  # ZeRO-1/2 rows are counted at torch.distributed, as zero1/2
        result.update(saved_param_bytes=ours.get("saved_param_bytes"), saved_other_bytes=ours.get("saved_other_bytes"),
                      saved_source="engine_report", comm_source="engine_report",
                      allgather_bytes_per_step=ours.get("allgather_bytes", 0) / args.steps,
                      reduce_scatter_bytes_per_step=ours.get("reduce_scatter_bytes", 0) / args.steps,
                      peak_gathered_bytes=ours.get("peak_gathered_bytes"))
    if timeline is not None:
        t, v = _downsample(timeline.times_s, timeline.live_bytes)
        result["timeline"] = {"times_s": t, "live_bytes": v, "marks": timeline.marks,
                              "inferred_frees": timeline.inferred_frees}
    if gathered:
        # the runtime's own clock, from just before the measured step (the profiler window starts there too)
        result["gathered_timeline"] = {"times_s": [t - gathered_t0 for t, _ in gathered],
                                       "live_bytes": [b for _, b in gathered]}
    if spans:
        # when each all-gather / reduce-scatter was in flight (issue to the end of its wait), same clock
        result["collective_spans"] = [(kind, start - gathered_t0, end - gathered_t0) for kind, start, end in spans]
    return result


def elements(text: str) -> int:
    """A count of elements for argparse: a whole number, 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of elements, 0 or more, got {value}")
    return value


def add_setting_args(p: argparse.ArgumentParser) -> None:
    """The settings ``run.py`` takes and hands to every worker as they are (``setting_argv``)."""
    p.add_argument("--zero-settings", choices=("tuned", "defaults", "offload", "hf-auto"), default="tuned",
                   help="ZeRO knobs of the DeepSpeed rows: sized to the model (tuned), DeepSpeed's defaults (only "
                        "the stage set), the defaults with parameters and optimizer offloaded to the CPU (offload), or "
                        "Hugging Face's ZeRO-2 or ZeRO-3 example config with its \"auto\" values filled from the "
                        "hidden size (hf-auto)")
    p.add_argument("--fsdp2-autocast", choices=("policy", "torch"), default="policy",
                   help="FSDP2 rows under autocast: FSDP2's mixed-precision policy (bf16 parameters and compute, the "
                        "default) or torch.autocast over fp32 parameters, the numerics of DeepSpeed's torch_autocast")
    p.add_argument("--sub-group-size", type=elements, default=0,
                   help="ZeRO-3's sub_group_size for the DeepSpeed rows (elements an optimizer step takes at once; "
                        "0: as --zero-settings has it, DeepSpeed's 1e9 unless hf-auto)")
    p.add_argument("--adam", choices=("torch", "deepspeed"), default="torch",
                   help="the DeepSpeed rows' AdamW: torch's (\"torch_adam\": true; out of place, two temporaries the "
                        "size of what it steps on) or DeepSpeed's own, as a section naming only \"AdamW\" gets (its "
                        "FusedAdam: on CPU a C++ kernel built on first use, in place)")
    p.add_argument("--activation-memory-budget", type=float, default=1.0,
                   help="torch's partitioner budget (torch._functorch.config.activation_memory_budget) for every "
                        "compiled row alike; below 1.0 it recomputes more to save fewer activations")


def setting_argv(args: argparse.Namespace) -> List[str]:
    return ["--zero-settings", args.zero_settings, "--fsdp2-autocast", args.fsdp2_autocast,
            "--sub-group-size", str(args.sub_group_size), "--adam", args.adam,
            "--activation-memory-budget", str(args.activation_memory_budget)]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", choices=ROWS, required=True)
    p.add_argument("--backend", choices=("eager", "inductor"), default="eager")
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--model", default="gpt")
    p.add_argument("--size", type=size_arg, default="small", help=f"{', '.join(SIZES)}, or NAME:LAYERS")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compile) step")
    p.add_argument("--seed", type=int, default=0)
    add_setting_args(p)
    p.add_argument("--progress", action="store_true", help="print one line per step on rank 0")
    p.add_argument("--out", help="JSON result path (rank 0)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    result = run(args)
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
