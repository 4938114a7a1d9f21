# SPDX-License-Identifier: Apache-2.0
"""The CUDA path on one NVIDIA GPU: native op build, native vs Python gather, DeepCompile vs eager ZeRO-3, memory.

    bash scripts/gpu_check.sh                 # sets up the environment, then runs this
    python scripts/gpu_check.py [--size small] [--steps 10] [--out out/gpu]

Each part runs in its own process on one NCCL rank, so a crash or hang in one is reported while the others
still run, and each training run's peak memory is its own:

- ``build``: ``NativeOpBuilder`` compiles and loads the op with its CUDA kernel (first; the others load it).
- ``gather``: native vs Python fused cast + all-gather (``deepspeed/compile/native/gather.py``), bitwise, fp32
  shards to bf16 / fp16 / fp32, on the default group and a subgroup, with shards written just before the
  gather (on the caller's stream, on a side stream, by a long matmul) so a missing stream dependency shows.
- ``train``: the benchmark Llama (``benchmarks/models.py``), ``--steps`` steps, eager ZeRO-3 and DeepCompile
  (``engine.compile(backend="eager")``) with the same ZeRO-3 config as the benchmarks
  (``benchmarks/worker.ds_config``): fp32 (eager, ours min_cut) and autocast bf16 (eager, ours min_cut, ours
  default). Peak memory is ``torch.cuda.max_memory_allocated``.

Gates: the build has the CUDA kernel; every gathered buffer is bitwise equal; fp32 losses are equal to eager
ZeRO-3's, step by step (deterministic algorithms and the math attention kernel in both, so that a difference
is the pipeline's, not a kernel's atomics); autocast losses within AUTOCAST_RTOL. Prints one table, writes
``gpu_check.json`` and one log per part under ``--out``; exits non-zero if a gate fails. Refuses (SystemExit)
where torch sees no GPU.
"""
import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = float(1 << 20)
TRAIN_RUNS: Tuple[Tuple[str, str], ...] = (("zero3", "fp32"), ("ours-min_cut", "fp32"), ("zero3", "autocast"),
                                          ("ours-min_cut", "autocast"), ("ours-default", "autocast"))
# autocast(bf16): eager ZeRO-3 runs linear layers through its own autograd function, the compiled graph through
# aten's decomposition; both round in bf16 (unit round-off 2^-9) in a different order. Same bound as the unit
# tests' (check_bf16_against_eager in tests/unit/compile/compare.py).
AUTOCAST_RTOL = 1e-2
GATHER_DTYPES = ("fp32", "bf16", "fp16")
GATHER_NUMELS = (36, 37, 4099, 1 << 22)
# Each part's limit: build, then the rest side by side, stays under 8 minutes with the set-up before it.
TIMEOUT_S = {"build": 180.0, "gather": 150.0, "train": 200.0}


def require_gpu() -> None:
    """SystemExit naming what is missing unless torch sees a CUDA GPU."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(f"gpu_check: needs an NVIDIA GPU, but torch.cuda.is_available() is False here "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). Run it on a "
                         f"machine with one GPU and a CUDA build of torch: bash scripts/gpu_check.sh")


# ----- in each part's process ------------------------------------------------------------------------------------
def _use_checkout() -> None:
    """This checkout's deepspeed.compile on DeepSpeed's CUDA accelerator, one rank (before deepspeed is imported)."""
    os.environ["DS_ACCELERATOR"] = "cuda"
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    sys.path.insert(0, REPO_ROOT)
    from benchmarks.checkout import use_checkout
    use_checkout()


def _init_nccl(workdir: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(workdir, "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    deepspeed.init_distributed(dist_backend="nccl")


def part_build(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME
    from deepspeed.compile.native.builder import NativeOpBuilder
    builder = NativeOpBuilder()
    if not builder.with_cuda():
        return {"ok": False, "error": f"the builder would leave the CUDA kernel out (torch.version.cuda="
                                      f"{torch.version.cuda}, CUDA_HOME={CUDA_HOME})"}
    t0 = time.perf_counter()
    library = builder.load(verbose=True)
    has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key("dsc_native::cast_all_gather", "CUDA")
    return {"ok": bool(has_cuda), "library": library, "build_s": time.perf_counter() - t0, "cuda_kernel": has_cuda,
            "error": None if has_cuda else "the library has no CUDA kernel for dsc_native::cast_all_gather"}


def part_gather(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from deepspeed.compile.native import cast_all_gather_python, load_native
    _init_nccl(args.workdir)
    native = load_native("native")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    device = torch.device("cuda", 0)
    subgroup = dist.new_group([0])  # a non-default group resolves by its own name
    side = torch.cuda.Stream()
    checked, mismatches = 0, []

    def compare(label: str, shard: torch.Tensor, dtype: torch.dtype, group, timeout=None) -> None:
        nonlocal checked
        ours = native(shard, dtype, group, 1, timeout)
        ref = cast_all_gather_python(shard, dtype, group, 1)
        torch.cuda.current_stream().synchronize()
        same = (ours.dtype == ref.dtype == dtype and ours.shape == ref.shape == (shard.numel(), )
                and torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
                and torch.equal(ours.view(torch.uint8), shard.to(dtype).view(torch.uint8)))
        checked += 1
        if not same:
            mismatches.append(label)

    for numel in GATHER_NUMELS:
        for name, dtype in dtypes.items():
            for group_name, group in (("world", None), ("subgroup", subgroup)):
                # written on the caller's stream just before the gather: the op must wait for it
                shard = torch.randn(numel, device=device) * 3.0
                compare(f"{numel}/{name}/{group_name}", shard, dtype, group)
            with torch.cuda.stream(side):  # the caller on a side stream
                shard = torch.randn(numel, device=device) * 3.0
                compare(f"{numel}/{name}/side-stream", shard, dtype, None)
    a = torch.randn(4096, 4096, device=device)
    for name, dtype in dtypes.items():  # produced by a long kernel right before the gather
        compare(f"matmul/{name}", (a @ a).reshape(-1), dtype, None)
    compare("timeout/bf16", torch.randn(4099, device=device), torch.bfloat16, None, datetime.timedelta(seconds=30))
    return {"ok": not mismatches, "checked": checked, "mismatches": mismatches,
            "error": f"{len(mismatches)} of {checked} gathered buffers differ" if mismatches else None}


def part_train(args: argparse.Namespace) -> Dict[str, Any]:
    import deepspeed
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from benchmarks.models import SIZES, make_batch, make_model, parameter_count
    from benchmarks.worker import ds_config
    from deepspeed.compile.report import engine_report
    _init_nccl(args.workdir)
    exact = args.dtype == "fp32"
    if exact:  # a difference must come from the pipeline, not from a kernel's atomics
        torch.use_deterministic_algorithms(True, warn_only=True)
    model = make_model("llama", args.size, seed=0)
    section = None
    if args.row != "zero3":
        section = {"deepcompile": True, "partitioner": args.row.split("-", 1)[1]}
    config = ds_config(args.dtype, parameter_count(model), SIZES[args.size].batch, section)
    torch.cuda.reset_peak_memory_stats()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    if section is not None:
        engine.compile(backend="eager")
    losses, first_peak, steady_base = [], 0, 0
    with sdpa_kernel(SDPBackend.MATH) if exact else contextlib.nullcontext():
        for step in range(args.steps):
            if step == 1:  # step 0 includes capture and compilation; later steps are the steady state
                torch.cuda.synchronize()
                first_peak, steady_base = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            idx, targets = (t.to(engine.device) for t in make_batch(args.size, step, 0))
            loss = engine(idx, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    torch.cuda.synchronize()
    steady_peak = torch.cuda.max_memory_allocated()
    stats = engine_report(engine) if section is not None else None
    active = engine.is_deepcompile_active() if section is not None else None
    return {"ok": section is None or bool(active), "losses": losses, "deepcompile_active": active,
            "peak_bytes": max(first_peak, steady_peak), "steady_peak_bytes": steady_peak,
            "steady_start_bytes": steady_base, "gather_path": None if stats is None else stats["gather_path"],
            "saved_param_bytes": None if stats is None else stats["saved_param_bytes"],
            "attention": "math" if exact else "default", "deterministic": exact,
            "error": None if section is None or active else "the engine is not running DeepCompile"}


PARTS = {"build": part_build, "gather": part_gather, "train": part_train}


def run_part(args: argparse.Namespace) -> int:
    """Child process: one part; its result (or the error) goes to ``--result`` as JSON."""
    require_gpu()
    _use_checkout()
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
            args.workdir = workdir
            result = PARTS[args.part](args)
    except Exception as err:  # reported in the table; the traceback is in the part's log
        import traceback
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


# ----- the parent: launch the parts, check, print -------------------------------------------------------------
def _launch(args: argparse.Namespace, name: str, part: str, extra: List[str]) -> Tuple[subprocess.Popen, str, Any]:
    stem = os.path.join(args.out, "runs", name.replace("/", "-"))
    result = stem + ".json"
    if os.path.exists(result):
        os.remove(result)
    log = open(stem + ".log", "w")
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO_ROOT, "build", "torch_extensions"))
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--result", result, "--size", args.size,
           "--steps", str(args.steps), *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT), result, log


def run_parts(args: argparse.Namespace, parts: Dict[str, Tuple[str, List[str]]]) -> Dict[str, Dict[str, Any]]:
    """Run ``parts`` ({name: (part, extra args)}) side by side; each one's result, or why it has none."""
    started = {name: (time.perf_counter(), *_launch(args, name, part, extra)) for name, (part, extra) in parts.items()}
    results = {}
    for name, (t0, proc, path, log) in started.items():
        limit = TIMEOUT_S[parts[name][0]]
        try:
            proc.wait(timeout=max(1.0, t0 + limit - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        if os.path.exists(path):
            with open(path) as f:
                results[name] = json.load(f)
        else:
            how = f"exit {proc.returncode}" if proc.returncode >= 0 else f"killed after {limit:.0f} s"
            results[name] = {"ok": False, "error": f"no result ({how}), see {os.path.relpath(log.name, REPO_ROOT)}"}
        results[name]["wall_s"] = time.perf_counter() - t0
    return results


def max_rel_diff(a: List[float], b: List[float]) -> float:
    """Largest relative difference of ``b`` from ``a``, element by element (``a`` is the reference)."""
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def check_losses(results: Dict[str, Dict[str, Any]]) -> None:
    """Compare each DeepCompile run's losses with eager ZeRO-3's of the same dtype (``loss_check``, ``ok``)."""
    for row, dtype in TRAIN_RUNS:
        r, ref = results[f"{row}/{dtype}"], results[f"zero3/{dtype}"]
        if row == "zero3" or "losses" not in r:
            continue
        if "losses" not in ref:
            r["loss_check"], r["ok"] = "no eager ZeRO-3 reference", False
            continue
        rel = max_rel_diff(ref["losses"], r["losses"])
        if dtype == "fp32":
            equal = r["losses"] == ref["losses"]
            r["loss_check"] = "equal" if equal else f"NOT equal (max rel diff {rel:.1e})"
        else:
            equal = rel <= AUTOCAST_RTOL
            r["loss_check"] = f"{rel:.1e} <= {AUTOCAST_RTOL:g}" if equal else f"{rel:.1e} > {AUTOCAST_RTOL:g}"
        r["loss_rel_diff"], r["ok"] = rel, r["ok"] and equal


def table(results: Dict[str, Dict[str, Any]]) -> str:
    def mib(value: Optional[float]) -> str:
        return "" if value is None else f"{value / MiB:.1f}"

    lines = ["| part | result | final loss | loss vs eager ZeRO-3 | peak (MiB) | peak, steps 2+ (MiB) | "
             "saved params (MiB) | gather path | wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        status = "ok" if r.get("ok") else f"**FAILED**: {r.get('error') or r.get('loss_check')}"
        if name == "build" and r.get("ok"):
            status = f"ok (CUDA kernel registered, {r['build_s']:.0f} s)"
        elif name == "gather" and r.get("ok"):
            status = f"ok ({r['checked']} buffers bitwise equal)"
        loss = f"{r['losses'][-1]:.5f}" if r.get("losses") else ""
        check = r.get("loss_check", "reference" if name.startswith("zero3/") and r.get("losses") else "")
        lines.append(f"| {name} | {status} | {loss} | {check} | {mib(r.get('peak_bytes'))} | "
                     f"{mib(r.get('steady_peak_bytes'))} | {mib(r.get('saved_param_bytes'))} | {r.get('gather_path') or ''} | "
                     f"{r['wall_s']:.0f} |")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=("small", "large"), help="benchmark model size")
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "out", "gpu"))
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # internal: one part, in a child
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.part:
        return run_part(args)
    require_gpu()
    import torch
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    t0 = time.perf_counter()
    results = run_parts(args, {"build": ("build", [])})  # first: the other parts load the library it built
    results.update(run_parts(args, {"gather": ("gather", []), **{
        f"{row}/{dtype}": ("train", ["--row", row, "--dtype", dtype]) for row, dtype in TRAIN_RUNS}}))
    check_losses(results)
    head = (f"## gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"Llama {args.size}, {args.steps} steps, 1 rank (NCCL)")
    print(head + "\n\n" + table(results))
    path = os.path.join(args.out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
                   "size": args.size, "steps": args.steps, "autocast_rtol": AUTOCAST_RTOL, "results": results}, f,
                  indent=1)
    failed = [name for name, r in results.items() if not r.get("ok")]
    print(f"\nJSON: {path}; logs: {os.path.join(args.out, 'runs')}; {time.perf_counter() - t0:.0f} s; "
          + (f"FAILED: {', '.join(failed)}" if failed else "all checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
