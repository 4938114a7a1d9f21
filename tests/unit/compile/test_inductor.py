# SPDX-License-Identifier: Apache-2.0
"""The pipeline under ``backend="inductor"``, against eager ZeRO-3 trained in the same process (2 gloo ranks).

Inductor compiles take 30-60 s per configuration on 2 CPU cores: each 2-rank test is one spawned run (the first
also compiles the model block by block, ``regions: "blocks"``, in fp32, its gathers coalesced; the checkpoint test
compiles with a ``compile_kwargs`` inductor option; the warm-process test runs three in turn).

Tolerances: inductor fuses and reorders fp32 arithmetic (layer-norm and softmax reductions, fused matmul
epilogues), so results are not bitwise equal to eager ZeRO-3. In fp32, gradients (after each backward of the first
steps), the fp32 master weights' first SGD update (lr times the gradient applied) and every loss must agree
within 1e-5 relative, norm-wise per parameter: reordering a sum of n terms changes it by at most about
n * 2^-24 relative, and the longest reductions here are a few hundred terms (measured: 5e-7 on gradients, 2e-7 on
losses, 3.5e-6 on the first update, to which rounding the fp32 master weight, 2^-24 of a weight far larger than
its update, adds).
Under autocast(bf16) the bounds of test_pipeline.py apply (twice eager ZeRO-3's own bf16 gradient error against
fp32; the step-0 loss within 2^-8, the others within 1e-2). SGD, so that parameters carry the gradients' scale.
"""
import uuid

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from distributed import run_distributed
from deepspeed.compile.engine_state import runtime_of  # noqa: E402

STEPS = 6
FP32_TOL = 1e-5


def _inductor_pairs():
    from compare import run_compiled, run_pair
    out = {}
    for dtype in ("fp32", "autocast"):
        out[dtype] = run_pair("gpt", STEPS, dtype=dtype, backend="inductor", optimizer="sgd", grad_steps=1)
    out["autocast"]["fp32_grads"] = out["fp32"]["eager_grads"]  # eager ZeRO-3 in fp32 from the same start
    # block by block: one compiled graph for both blocks, against the same eager ZeRO-3 run; gathers coalesced (a
    # prefetch bucket of 3000 elements, as test_parity_options.py's blocks case: each block graph has several runs,
    # started ahead across the block graphs; eager ZeRO-3's arithmetic does not depend on the bucket)
    eager = {key: value for key, value in out["fp32"].items() if key.startswith("eager_")}
    out["blocks"] = {**eager, **run_compiled("gpt", STEPS, compile_section={"regions": "blocks"}, backend="inductor",
                                             optimizer="sgd", grad_steps=1,
                                             zero_overrides={"stage3_prefetch_bucket_size": 3000})}
    # the fp32 case with the collectives on the process group, against the same eager ZeRO-3 run
    out["gloo"] = {**eager, **run_compiled("gpt", STEPS, compile_section={"host_comm": "gloo"}, backend="inductor",
                                           optimizer="sgd", grad_steps=1)}
    return out


@pytest.fixture(scope="module")
def inductor_pairs():
    return run_distributed(_inductor_pairs, timeout_s=540)


def check_fp32_close(r):
    from compare import check_fp32_close
    return check_fp32_close(r, FP32_TOL)


def test_inductor_on_the_process_group_matches_eager_zero3(inductor_pairs):
    """The fp32 case of the test below with the collectives on the process group (compile.host_comm "gloo"): the same
    graphs, another transport, bit for bit the shared-memory run's."""
    from compare import assert_ran_compiled, assert_same_training, assert_transport
    for out in inductor_pairs:
        r = out["gloo"]
        assert_ran_compiled(r)
        assert_transport(r, "gloo")
        assert_transport(out["fp32"], "auto")
        print("fp32 on gloo:", check_fp32_close(r))
        # the same generated code on both transports, gathers that copy bits and 2-term sums (a + b == b + a): the
        # same bits as the shared-memory run
        assert_same_training(r, out["fp32"])


def test_inductor_matches_eager_zero3_and_saves_no_parameter(inductor_pairs):
    from compare import assert_one_graph_serves_both_blocks, check_bf16_against_eager, loss_fell
    for out in inductor_pairs:
        print("fp32:", check_fp32_close(out["fp32"]))
        print("autocast:", check_bf16_against_eager(out["autocast"], "autocast"))
        for dtype in ("fp32", "autocast"):
            r = out[dtype]
            assert r["active"]
            assert loss_fell(r["losses"], by=0.002), (dtype, r["losses"])
            assert r["saved"]["param_bytes"] == 0 and r["saved"]["other_bytes"] > 0, (dtype, r["saved"])
            assert r["live_after_step"] == [0] * STEPS
            assert r["counters"]["gathers"] > 0
        assert out["autocast"]["counters"]["allgather_bytes_by_dtype"]["torch.bfloat16"] > 0  # fused cast
        blocks = out["blocks"]
        print("fp32, regions='blocks':", check_fp32_close(blocks))
        # one graph compiled, for the first block, ran compiled for the second too; nothing of it saved a parameter
        assert blocks["active"]
        assert_one_graph_serves_both_blocks(blocks)
        # inductor compiled the block's graph only; the graphs outside the blocks (the model's frame around them and
        # its leaf regions, each a piece or two of the model) ran on the eager backend
        by_backend = blocks["graphs_by_backend"]
        assert by_backend.get("inductor") == 1 and by_backend.get("eager", 0) >= 2, by_backend
        assert out["fp32"]["graphs_by_backend"] == {"inductor": out["fp32"]["graphs"]}, out["fp32"]
        # as with the eager backend (test_parity_options.py): outside the blocks only what the model's own frame
        # reads as Python is gathered on access, once a step (the position table and the tied embedding weight of
        # its output head); from the second step on every run but the step's first was started ahead (measured: 12
        # eager gathers in 6 steps, 27 runs a step, 148 started ahead)
        assert blocks["counters"]["eager_gathers"] == 2 * STEPS, blocks["counters"]
        runs = blocks["runs_per_step"]
        assert runs >= 12 and blocks["counters"]["runs_started_ahead"] >= (STEPS - 1) * (runs - 1), (
            runs, blocks["counters"])
        assert blocks["saved"]["param_bytes"] == 0 and blocks["live_after_step"] == [0] * STEPS


class _CountingPass(CustomGraphPass):
    """An inductor post-grad pass that changes nothing and counts the graphs it ran on. A fresh uuid per instance:
    no cache entry stands in for compiling with it."""

    def __init__(self):
        self.graphs = 0
        self._uuid = uuid.uuid4().hex

    def __call__(self, graph):
        self.graphs += 1

    def uuid(self):
        return self._uuid


def _accumulation_and_checkpoint(ckpt_dir):
    """Gradient accumulation (2 micro-steps) against eager ZeRO-3, then a checkpoint round trip of the inductor
    engine: save after 2 steps, train 2, load, train the same 2 again."""
    from compare import full_params, run_eager, train_and_record, unequal
    from models import ds_config
    from training import make_engine, train
    out = run_eager("gpt", 2, grad_accum=2, grad_steps=2, optimizer="sgd")
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True}, grad_accum=2, optimizer="sgd"))
    # inductor options as Accelerate passes them (compile_kwargs of engine.compile): a post-grad pass that changes
    # nothing and counts the graphs inductor compiled with it
    counting = _CountingPass()
    out.update(train_and_record(engine, "gpt", 2, 2, compile_kwargs={
        "backend": "inductor", "compile_kwargs": {"options": {"post_grad_custom_pre_pass": counting}}}))
    out["graphs_with_options"] = counting.graphs
    engine.save_checkpoint(ckpt_dir, tag="inductor")
    saved = full_params(engine)
    out["after_save"] = train(engine, "gpt", 2, first_step=2)
    engine.load_checkpoint(ckpt_dir, tag="inductor")
    out["restored_unequal"] = unequal(saved, full_params(engine))
    out["active_after_load"] = engine.is_deepcompile_active()
    gathers = runtime_of(engine, active_only=False).counters.gather.gathers
    out["after_load"] = train(engine, "gpt", 2, first_step=2)
    out["gathers_after_load"] = runtime_of(engine, active_only=False).counters.gather.gathers - gathers
    return out


def test_inductor_gradient_accumulation_checkpoint_and_compile_options(tmp_path):
    for r in run_distributed(_accumulation_and_checkpoint, str(tmp_path), timeout_s=540):
        assert len(r["grads"]) == 4  # after each of the 4 backwards
        assert r["graphs_with_options"] >= 2, r["graphs_with_options"]  # forward and backward got the options
        assert not torch.equal(r["grads"][0]["tok.weight"], r["grads"][1]["tok.weight"])  # accumulated
        print("fp32 accumulation:", check_fp32_close(r))
        assert r["restored_unequal"] == []
        assert r["active_after_load"], "DeepCompile is no longer active after load_checkpoint"
        assert r["gathers_after_load"] > 0
        # the same compiled code on the same state: bitwise the same losses
        assert r["after_load"] == r["after_save"], (r["after_save"], r["after_load"])


def _dropout_run(options):
    """The MLP with dropout: 3 steps (the same seed before each on every engine), an evaluation (engine.eval(),
    no_grad) after each, and the evaluation twice more at the end. ``options``: None for eager ZeRO-3, else the
    inductor options of a DeepCompile engine."""
    import torch.distributed as dist
    from compare import full_params
    from models import ds_config, make_batch
    from training import make_engine
    torch._dynamo.reset()
    engine = make_engine("dropout", ds_config(3, None if options is None else {"deepcompile": True}, optimizer="sgd"))
    if options is not None:
        engine.compile(backend="inductor", compile_kwargs={"options": options} if options else {})
    rank = dist.get_rank()
    out = {"losses": [], "evals": []}

    def evaluate():
        engine.eval()
        with torch.no_grad():
            out["evals"].append(engine(*make_batch("dropout", 99, rank)).item())
        engine.train()

    engine.eval()
    with torch.no_grad():  # the first batch's loss without dropout, with the weights it is trained on first
        out["first_batch_eval"] = engine(*make_batch("dropout", 0, rank)).item()
    engine.train()
    for step in range(3):
        torch.manual_seed(step)
        loss = engine(*make_batch("dropout", step, rank))
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
        evaluate()
    evaluate()
    out.update(params=full_params(engine))
    if options is not None:  # what assert_ran_compiled reads
        from compare import compiled_record
        out["ran"] = compiled_record(engine)
    engine.destroy()
    return out


def _dropout_runs():
    # fallback_random: inductor draws its random numbers as eager torch does, so the masks are eager ZeRO-3's
    return {"eager": _dropout_run(None), "fallback_random": _dropout_run({"fallback_random": True}),
            "default": _dropout_run({})}


def test_inductor_trains_a_model_with_dropout():
    """Inductor's joint-graph passes replace random ops (dropout) and read the fake mode from inductor's virtualized
    context, which compile_fx sets around AOTAutograd and our compile did not: the first step failed
    (BackendCompilerFailed: "'NullHandler' object does not support the context manager protocol"). With torch's
    random numbers (``fallback_random``) the masks are eager ZeRO-3's, and losses, evaluations and parameters agree
    within FP32_TOL; with inductor's own (its default) the masks differ, and training runs compiled with dropout off
    in evaluation."""
    import math
    from compare import assert_ran_compiled, max_rel_diff, rel_diffs
    for r in run_distributed(_dropout_runs, timeout_s=400):
        eager, same, default = r["eager"], r["fallback_random"], r["default"]
        for run in (same, default):  # the compiled graphs gathered and reduced (not eager ZeRO-3 under the flag)
            assert_ran_compiled(run["ran"])
        worst = {"loss": max_rel_diff(eager["losses"], same["losses"]),
                 "eval": max_rel_diff(eager["evals"], same["evals"]),
                 "params": max(rel_diffs(same["params"], eager["params"]).values())}
        assert all(v <= FP32_TOL for v in worst.values()), worst
        assert all(math.isfinite(x) for x in default["losses"] + default["evals"]), default
        assert default["evals"][-1] == default["evals"][-2]  # no dropout in evaluation
        for run in (eager, same, default):  # ... and dropout in training, on the same weights and batch
            assert run["losses"][0] != run["first_batch_eval"], run
        assert default["losses"][0] != same["losses"][0], (default["losses"], same["losses"])  # inductor's masks


CONV_CASES = {"zero3, gathered again in backward": {},
              "zero3, kept gathered for backward": {"zero_overrides": {"stage3_max_reuse_distance": 10**9}},
              "zero2": {"stage": 2}, "zero1": {"stage": 1}}


def _conv_pairs():
    from compare import run_pair
    return {case: run_pair("conv", 3, backend="inductor", optimizer="sgd", grad_steps=1, **kwargs)
            for case, kwargs in CONV_CASES.items()}


def test_inductor_trains_convolutions_at_every_stage():
    """A Conv2d patch embedding and a Conv1d (ViT's and Whisper's front ends). On CPU inductor's layout optimization
    gave a 2-D convolution's weight a channels-last copy that stood in for it at all its uses, the copy handed to our
    ops (the Conv1d's 3-D weight was not affected): ZeRO-3's release failed ("not a gathered parameter"), in forward when the parameter is gathered again in
    backward and in backward when it is kept, and ZeRO-1/2's reduce did not know the parameter. Each stage against
    eager ZeRO in the same process, within FP32_TOL."""
    from compare import assert_ran_compiled
    for by_case in run_distributed(_conv_pairs, timeout_s=400):
        for case, r in by_case.items():
            assert_ran_compiled(r)
            if "zero3" in case:
                assert r["counters"]["eager_gathers"] == 0 and r["counters"]["live_gathered_bytes"] == 0, (
                    case, r["counters"])
                assert {"patch.weight", "mix.weight"} <= set(r["gathered_params"]), (case, r["gathered_params"])
            print(case, check_fp32_close(r))


def _checkpointed_pair():
    from compare import run_pair
    return run_pair("gpt_checkpointed", 3, backend="inductor", optimizer="sgd", grad_steps=1)


def test_inductor_compiles_deepspeed_activation_checkpointing():
    """``deepspeed.checkpointing.checkpoint`` around each block (test_parity_usage.py has the eager backend): inductor
    compiles the blocks too, gathering their parameters in the graph (none on access), and matches eager ZeRO-3,
    which runs DeepSpeed's own function, within FP32_TOL."""
    from compare import assert_ran_compiled
    for r in run_distributed(_checkpointed_pair, timeout_s=400):
        assert_ran_compiled(r)
        assert r["counters"]["eager_gathers"] == 0, r["counters"]
        assert "blocks.1.up.weight" in r["gathered_params"], r["gathered_params"]
        print(check_fp32_close(r))


def _one_process(steps, aot_cache=True, prefetch_bucket=0, stage=3):
    """One training process: the inductor engine, with what its stats say about compiling and torch's cache."""
    import time
    from torch._dynamo.utils import counters
    from compare import full_params
    from deepspeed.compile.engine_state import state_of
    from deepspeed.compile.report import engine_report
    from models import ds_config
    from training import make_engine, train
    overrides = {"stage3_prefetch_bucket_size": prefetch_bucket} if stage == 3 else {}
    engine = make_engine("gpt", ds_config(stage, {"deepcompile": True, "aot_cache": aot_cache}, optimizer="sgd",
                                          zero_overrides=overrides))
    start = time.perf_counter()
    losses = train(engine, "gpt", 1, compile_kwargs={"backend": "inductor"})
    first_step_s = time.perf_counter() - start
    losses += train(engine, "gpt", steps - 1, first_step=1)
    stats = state_of(engine).stats
    report = engine_report(engine)
    return {"losses": losses, "params": full_params(engine), "first_step_s": first_step_s,
            "fused": (report.get("matmul_grads"), report.get("grads_in_bucket")),
            "aot": dict(counters["aot_autograd"]), "compiled": stats.graphs_compiled, "loaded": stats.graphs_loaded,
            "orders": stats.collective_orders, "peak": stats.planned_peak_gathered_bytes, "saved": vars(stats.saved),
            "compile_s": dict(stats.compile_seconds)}


def _processes(cases, cache_tag: str):
    """``_one_process`` for each case in turn, in one launch (dynamo and its counters reset between): the cases of
    one launch share the process, as a user's consecutive engines would, and only the disk cache with the others.
    ``cache_tag`` goes into the key of every graph torch caches (``torch.compiler.config.cache_key_tag``)."""
    from torch._dynamo.utils import counters
    out = []
    with torch.compiler.config.patch(cache_key_tag=cache_tag):
        for case in cases:
            torch._dynamo.reset()
            counters.clear()
            out.append(_one_process(*case))
    return out


WARM_STEPS = 3
# (steps, aot_cache, prefetch_bucket, stage): ZeRO-3, ZeRO-2, ZeRO-3 with "aot_cache": false, ZeRO-3 whose passes
# build other graphs (a 3000-element prefetch bucket: gathers coalesced into runs)
ZERO3, ZERO2, NO_CACHE, RUNS = (WARM_STEPS, True, 0, 3), (WARM_STEPS, True, 0, 2), (WARM_STEPS, False), \
    (WARM_STEPS, True, 3000)


@pytest.fixture(scope="module")
def cache_launches():
    """Three launches in turn (each a 2-rank run) whose cached graphs no other run can have cached: their graph
    cache keys carry a tag of their own. The first compiles ZeRO-3's and ZeRO-2's graphs, the second is a warm
    process for both, the third compiles without the cache, then with other ZeRO settings. Each returns its cases'
    results, per rank. The C++ kernels inductor builds for the graphs are cached by their source, not by graph: they
    come from the suite's inductor cache where other tests built them (a fresh cache directory built them again)."""
    tag = f"warm-process-test-{uuid.uuid4().hex}"
    return {name: run_distributed(_processes, cases, tag, timeout_s=450)
            for name, cases in (("cold", (ZERO3, ZERO2)), ("warm", (ZERO3, ZERO2)), ("other", (NO_CACHE, RUNS)))}


def test_warm_process_loads_the_compiled_graphs_and_trains_identically(cache_launches):
    """The first process compiles every graph and torch's AOTAutograd cache stores it; the second loads every graph
    from it (our compilers do not run) and trains bitwise identically, and its report's compile figures (collective
    order, saved bytes, planned peak) are the first's, from the compile record. With ``"aot_cache": false`` every
    graph compiles again, and so does every graph of an engine whose ZeRO settings change what the passes build,
    with the same arithmetic."""
    for cold, warm, other in zip(*(cache_launches[name] for name in ("cold", "warm", "other"))):
        c, w = cold[0], warm[0]
        assert c["compiled"] > 0 and c["loaded"] == 0 and c["aot"].get("autograd_cache_hit", 0) == 0, c["aot"]
        assert c["compile_s"]["forward"] > 0 and c["compile_s"]["backward"] > 0 and c["compile_s"]["partition"] > 0
        assert w["loaded"] == w["compiled"] == c["compiled"], (w["loaded"], w["compiled"], c["compiled"])
        assert w["aot"].get("autograd_cache_hit", 0) == c["compiled"], w["aot"]
        assert w["compile_s"] == {"forward": 0.0, "backward": 0.0, "partition": 0.0}, w["compile_s"]
        assert w["losses"] == c["losses"], (c["losses"], w["losses"])
        assert all(torch.equal(w["params"][k], c["params"][k]) for k in c["params"])
        assert (w["orders"], w["saved"], w["peak"]) == (c["orders"], c["saved"], c["peak"])
        assert any(order for order in c["orders"]), "the graphs issue no collectives"
        print(f"first step: cold {c['first_step_s']:.1f} s, warm {w['first_step_s']:.1f} s")
        off, runs = other
        assert off["loaded"] == 0 and off["aot"].get("autograd_cache_hit", 0) == 0, off["aot"]
        assert off["compiled"] == c["compiled"] and off["compile_s"]["forward"] > 0
        assert off["losses"] == c["losses"] and (off["orders"], off["saved"]) == (c["orders"], c["saved"])
        assert runs["loaded"] == 0 and runs["aot"].get("autograd_cache_hit", 0) == 0, runs["aot"]
        assert runs["compiled"] == c["compiled"] and runs["losses"] == c["losses"]


def test_warm_process_at_zero2_loads_the_graphs_with_their_fused_reduces(cache_launches):
    """ZeRO-2 on inductor: a warm process loads its graphs from torch's AOTAutograd cache, and the loaded backward
    still computes each linear weight's gradient in its reduce, in ZeRO's bucket (``reduce_grad_mm``, registered as
    having a side effect: no cached graph may have dropped it), training bitwise as the cold process did."""
    for cold, warm in zip(cache_launches["cold"], cache_launches["warm"]):
        c, w = cold[1], warm[1]
        assert c["compiled"] > 0 and c["loaded"] == 0 and w["loaded"] == w["compiled"] == c["compiled"], (c, w)
        assert w["aot"].get("autograd_cache_hit", 0) == c["compiled"], w["aot"]
        assert c["fused"][0] > 0 and c["fused"][1] > 0 and w["fused"] == c["fused"], (c["fused"], w["fused"])
        assert w["losses"] == c["losses"], (c["losses"], w["losses"])
        assert all(torch.equal(w["params"][k], c["params"][k]) for k in c["params"])


def test_compile_record_is_keyed_on_the_calling_context():
    """One dynamo graph compiles differently under autocast or without grad (torch's AOTAutograd key covers both;
    DeepSpeed's torch_autocast enters autocast outside the compiled frame, so fp32 and autocast engines trace the
    same code): each gets its own compile record, or a warm process would report one's figures for the other."""
    from deepspeed.compile.driver import cache
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    inputs = [torch.ones(2)]
    keys = {"plain": cache.record_key("k", gm, inputs)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        keys["autocast"] = cache.record_key("k", gm, inputs)
    with torch.no_grad():
        keys["no_grad"] = cache.record_key("k", gm, inputs)
    keys["other settings"] = cache.record_key("k2", gm, inputs)
    assert len(set(keys.values())) == len(keys), keys
    assert cache.record_key("k", gm, inputs) == keys["plain"]  # and the same context gives the same record


def _dynamo_graphs(lengths):
    """The dynamo graphs (with their example inputs) of one function called at ``lengths`` in turn: a static graph for
    the first length, then one dynamic graph serving the others."""
    caught = []

    def backend(gm, example_inputs):
        caught.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    weight = torch.nn.Parameter(torch.ones(4, 4))
    f = torch.compile(lambda x, w: (x @ w).sum(-1), backend=backend)
    for n in lengths:
        f(torch.ones(2, n, 4), weight)
    torch._dynamo.reset()
    return caught


def test_compile_record_of_a_dynamic_graph_is_keyed_on_its_symbolic_shapes():
    """A dynamic graph serves every length, and torch's AOTAutograd key says so; its record was keyed on the sizes of
    the call that compiled it. Two ranks whose first lengths differ (each rank pads its own batches) then wrote two
    records, and the rank that loaded the graph torch cached for the other found none: "loaded from torch's
    AOTAutograd cache without its compile record", its engine_report short of that graph (measured with Hugging
    Face's Trainer, inductor, 2 ranks: 2 graphs compiled on one rank, 3 on the other). Also in a warm process whose
    first length is not the cold one's."""
    from deepspeed.compile.driver import cache
    (static_8, _), (dynamic_9, inputs_9) = _dynamo_graphs([8, 9])
    (static_10, _), (dynamic_11, inputs_11) = _dynamo_graphs([10, 11])
    assert [t.shape[1] for t in (inputs_9[1], inputs_11[1])] == [9, 11]  # the compiling calls' own lengths
    assert cache.record_key("k", dynamic_9, inputs_9) == cache.record_key("k", dynamic_11, inputs_11)
    assert cache.input_signature(static_8, [torch.ones(2, 8, 4)]) != cache.input_signature(static_10,
                                                                                           [torch.ones(2, 10, 4)])


def test_compile_kwargs_mode_and_options_resolve_as_torch_compile_resolves_them(caplog):
    """What engine.compile(compile_kwargs=...) gives inductor: torch.compile's own resolution of mode and options; a
    bad value is refused at engine.compile(), naming the argument; with the eager backend a warning, nothing else."""
    import logging
    from deepspeed.compile.engine_state import inductor_settings
    assert inductor_settings("inductor", {}) == {} and inductor_settings("inductor", {"mode": "default"}) == {}
    assert inductor_settings("inductor", {"dynamic": False}) == {}
    assert inductor_settings("inductor", {"mode": "max-autotune-no-cudagraphs"}) == \
        torch._TorchCompileInductorWrapper("max-autotune-no-cudagraphs", None, None).config
    assert inductor_settings("inductor", {"mode": "max-autotune-no-cudagraphs"})["max_autotune"] is True
    assert inductor_settings("inductor", {"options": {"epilogue_fusion": False}}) == {"epilogue_fusion": False}
    with pytest.raises(ValueError, match="options.*no_such_option"):
        inductor_settings("inductor", {"options": {"no_such_option": 1}})
    with pytest.raises(ValueError, match="mode"):
        inductor_settings("inductor", {"mode": "no-such-mode"})
    with pytest.raises(ValueError, match="'mode' or 'options'"):
        inductor_settings("inductor", {"mode": "max-autotune", "options": {"epilogue_fusion": False}})
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        assert inductor_settings("eager", {"mode": "max-autotune"}) == {}
    finally:
        logger.removeHandler(caplog.handler)
    assert "do nothing with backend='eager'" in caplog.text
