# SPDX-License-Identifier: Apache-2.0
"""Sequence (and tensor) parallelism's step time and memory per rank against the same model unsplit, side by side.

    python benchmarks/sequence_parallel.py [--ranks 2] [--sizes 1,2] [--length 2048] [--rounds 2] [--steps 4] \
        [--backend eager|inductor] [--optimizer adamw|sgd] [--kind sp|tp]

Each row is one launch of ``--ranks`` CPU ranks (``torch.distributed.run``), so that its peak resident memory is its
own; the rows' launches alternate, ``--rounds`` times, and the medians of each row are compared. A row is DeepCompile
at ZeRO-3 (DeepSpeed's default ZeRO settings, fp32) on a ``transformers`` Llama with SDPA attention (``--layers``
layers of hidden size ``--hidden``), trained on ``--length`` tokens a sequence, micro-batch 1, every rank fed the
same sequence: size 1 is the model unsplit (each rank computes the whole sequence), size N splits each sequence over
N ranks (``"passes": ["autosp"]``, ``sequence_parallel_size`` N). ``--kind tp``: the rows are ZeRO-1 instead, and
size N shards the linear layers over N ranks with AutoTP (``tensor_parallel.autotp_size`` N, ``"passes":
["autotp"]``). An ``eagerN`` row is DeepSpeed's own, not compiled: ``eager1`` the model unsplit, ``eagerN``
(N > 1, ``--kind sp``) its Ulysses for HF models (``UlyssesSPAttentionHF.register_with_transformers``,
``sequence_parallel_size`` N), each rank fed its slice of the sequence with the slice's position ids and its labels
shifted before the slicing, the loss each slice's share of the sequence's mean summed over the SP group
differentiably, as DeepSpeed's Ulysses tutorial combines them (``--kind tp``: AutoTP's layers with their own
collectives). Reported per row: the median step, the peak resident memory of a rank (the largest over the ranks,
whole process), and the peak of live tensor bytes above the step's start in one traced step
(``benchmarks/memory.py``): what a step adds, the activations first of all. The rows' losses are printed too: the
same model's on the same data (with ``--optimizer sgd`` they agree to round-off; AdamW's first updates are about
``lr`` whatever a gradient's size, so round-off in a near-zero gradient shows in the later losses).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(args: argparse.Namespace) -> None:
    """One launch's rank: build, train, measure; rank 0 writes the row's JSON to ``args.out``."""
    sys.path.insert(0, REPO_ROOT)
    from benchmarks import worker  # noqa: F401  (selects this checkout's deepspeed.compile)
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from transformers import LlamaConfig, LlamaForCausalLM
    from benchmarks.memory import mark, step_peak, trace_memory
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    heads = max(args.hidden // 64, 2)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=args.length, attn_implementation="sdpa", use_cache=False))
    tensor = args.kind == "tp"
    ulysses = args.eager and args.size > 1 and not tensor  # DeepSpeed's own sequence parallelism, not compiled
    mpu = None
    if ulysses:  # Ulysses wraps SDPA in transformers' attention functions; its mpu holds the SP groups
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=args.size,
            micro_batch_size=1, seq_length=args.length, seq_length_is_variable=False)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}} if args.optimizer == "adamw"
              else {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1 if tensor else 3}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9,
              "compile": {"deepcompile": True}}
    config["compile"].update(json.loads(args.section))
    if args.eager:  # DeepSpeed's own, not compiled
        del config["compile"]
    if args.reduce_bucket_size:
        config["zero_optimization"]["reduce_bucket_size"] = args.reduce_bucket_size
    if args.size > 1 and not args.eager:
        config["compile"]["passes"] = ["autotp" if tensor else "autosp"]
    if args.size > 1 and tensor:
        config["tensor_parallel"] = {"autotp_size": args.size}
    elif args.size > 1:
        config["sequence_parallel_size"] = args.size
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                      mpu=mpu)
    if not args.eager:
        engine.compile(backend=args.backend)

    def step(i: int) -> float:
        g = torch.Generator().manual_seed(1000 * i)  # every rank the same sequence: the rows train alike
        ids = torch.randint(0, args.vocab, (1, args.length), generator=g)
        if ulysses:  # this rank's slice, the labels shifted first: a slice's last token predicts the next slice's first
            chunk = args.length // args.size
            part = slice(chunk * mpu.get_sequence_parallel_rank(), chunk * (mpu.get_sequence_parallel_rank() + 1))
            labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
            positions = torch.arange(args.length).unsqueeze(0)
        with mark("step"):
            if ulysses:  # the slice's share of the sequence's mean loss, summed over the SP group (differentiable)
                logits = engine(input_ids=ids[:, part], position_ids=positions[:, part]).logits
                share = engine.module.loss_function(logits=logits, labels=None, shift_labels=labels[:, part],
                                                    vocab_size=args.vocab, num_items_in_batch=args.length - 1)
                loss = funcol.all_reduce(share, "sum", mpu.get_sequence_parallel_group())
            else:
                loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        return loss.item()

    losses, times = [], []
    for i in range(1 + args.warm + args.steps):
        start = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - start)
    if args.profile:  # one more step, its ops by self CPU time (rank 0)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(len(times))
        if rank == 0:
            print(f"==== row {'eager' if args.eager else 'compiled'} size {args.size}: one step's ops", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile), flush=True)
    peak_rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(peak_rss, op=dist.ReduceOp.MAX)
    with trace_memory() as traced:  # two steps: the second starts with every transient block known
        step(len(times))
        step(len(times) + 1)
    window = step_peak(traced["timeline"], "step")
    peak_above = torch.tensor([float(window.peak_bytes if window is not None else 0)], dtype=torch.float64)
    dist.all_reduce(peak_above, op=dist.ReduceOp.MAX)
    if rank == 0:
        from deepspeed.compile.report import engine_report
        report = engine_report(engine) or {}
        with open(args.out, "w") as f:
            json.dump({"size": args.size, "first_step_s": times[0],
                       "median_step_s": statistics.median(times[1 + args.warm:]), "losses": losses,
                       "peak_rss_bytes": peak_rss.item(), "peak_above_start_bytes": peak_above.item(),
                       "sequence_collectives": report.get("sequence_collectives")}, f)
    engine.destroy()
    dist.destroy_process_group()


def _launch(args: argparse.Namespace, row: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    eager = row.startswith("eager")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks),
            os.path.abspath(__file__), "--row", "--size", row[len("eager"):] if eager else row, "--out", out,
            *(["--eager"] if eager else []),
            *[f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("length", "layers", "hidden", "vocab", "steps", "warm", "optimizer", "backend", "kind",
                        "reduce_bucket_size", "section", "profile")]]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    quiet = not (args.verbose or args.profile)
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL if quiet else None)
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", default="1,2", help="comma-separated size per row (1: unsplit); eagerN: DeepSpeed's own "
                   "at size N, not compiled (eagerN, N > 1: Ulysses; --kind tp: AutoTP's layers with their own "
                   "collectives)")
    p.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--section", default="{}", help="JSON object merged into the compiled rows' \"compile\" section")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warm", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", choices=("eager", "inductor"), default="eager")
    p.add_argument("--reduce-bucket-size", type=int, default=0,
                   help="zero_optimization.reduce_bucket_size (0: DeepSpeed's default, 5e8 elements, whose ZeRO-1/2 "
                        "bucket of 2 GB in fp32 is most of a ZeRO-1 step's peak)")
    p.add_argument("--kind", choices=("sp", "tp"), default="sp",
                   help="tp: size N rows shard the linears with AutoTP (tensor_parallel.autotp_size N, "
                        "\"passes\": [\"autotp\"]) at ZeRO-1, against ZeRO-1 unsplit")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="sgd: an update proportional to the gradient, so the rows' losses show their gradients agree "
                        "(AdamW's first steps move every weight by about lr whatever its gradient's size)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--profile", type=int, default=0, help="N > 0: print each row's N costliest ops (self CPU time) of "
                   "one more step, after the timed ones")
    args = p.parse_args()
    if args.row:
        _row(args)
        return
    sizes = args.sizes.split(",")
    results = {size: [] for size in sizes}
    for r in range(args.rounds):
        for size in (sizes if r % 2 == 0 else sizes[::-1]):
            results[size].append(_launch(args, size))
    base = sizes[0]

    def med(size, key):
        return statistics.median(x[key] for x in results[size])

    what = "autotp_size" if args.kind == "tp" else "sequence_parallel_size"
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.length} tokens a sequence, {args.ranks} ranks, "
          f"ZeRO-{1 if args.kind == 'tp' else 3} "
          f"{'defaults' if not args.reduce_bucket_size else f'reduce_bucket_size {args.reduce_bucket_size}'}, "
          f"{args.backend} backend, fp32, {args.optimizer}; medians "
          f"of {args.rounds} launches a row")
    print(f"| {what} | median step | vs size {base} | peak RSS a rank | vs size {base} | step's peak tensor bytes "
          f"above its start | vs size {base} | losses |")
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        step, rss, above = (med(size, k) for k in ("median_step_s", "peak_rss_bytes", "peak_above_start_bytes"))
        print(f"| {size} | {step:.3f} s | {step / med(base, 'median_step_s'):.2f}x | {rss / 2 ** 30:.2f} GiB | "
              f"{rss / med(base, 'peak_rss_bytes'):.2f}x | {above / 2 ** 20:.0f} MiB | "
              f"{above / med(base, 'peak_above_start_bytes'):.2f}x | "
              f"{', '.join(f'{x:.4f}' for x in results[size][0]['losses'])} |")


if __name__ == "__main__":
    main()
