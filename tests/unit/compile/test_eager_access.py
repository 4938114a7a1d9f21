# SPDX-License-Identifier: Apache-2.0
"""Code dynamo runs eagerly reads real parameters; variable-length batches compile at most twice per frame.

Every case trains eager ZeRO-3 and DeepCompile on the same data in the same ranks and compares. fp32 with the eager
backend does the same arithmetic in the same order (the eagerly run parts run through the very same modules, the
compiled parts gather the same shards, and the reduce-scatter pre-divides and sums as ZeRO-3 does), so losses and
gradients after every backward and final parameters are compared for equality, not within a tolerance. Inductor fuses
and reorders fp32 arithmetic: losses, gradients after every backward and the first SGD update within 1e-5 relative,
norm-wise per parameter (``compare.check_fp32_close``, as in test_inductor.py).
"""
from distributed import run_distributed
from deepspeed.compile.engine_state import runtime_of, state_of  # noqa: E402
from deepspeed.compile.report import engine_report  # noqa: E402

LR = 1e-3


def _config(section=None):
    from models import ds_config
    return ds_config(3, section, batch=2)


def _train(engine, name, steps, seq_of_step, grads=None):
    return [_train_one(engine, name, step, seq_of_step, grads) for step in range(steps)]


def _train_one(engine, name, step, seq_of_step, grads=None):
    """One step; with ``grads`` (a list), the full gradients after the backward are appended to it."""
    import torch
    import models_eager
    from compare import full_grads
    idx, targets = models_eager.batch(step, torch.distributed.get_rank(), seq_of_step(step))
    loss = engine(input_ids=idx, labels=idx).loss if name.startswith("gpt2") else engine(idx, targets)
    engine.backward(loss)
    if grads is not None:
        grads.append(full_grads(engine))
    engine.step()
    return loss.item()


def _frame_compiles():
    """How many times dynamo compiled each frame since its metrics were last cleared, by (file, line, name); the
    metrics' entries that name no frame (the backward graphs, compiled by AOTAutograd when the backward first runs)
    are left out."""
    import collections
    import torch
    return dict(collections.Counter((m.co_filename, m.co_firstlineno, m.co_name)
                                    for m in torch._dynamo.utils.get_compilation_metrics() if m.co_name is not None))


def _initialize(name, section, sgd):
    import deepspeed
    import torch
    import models_eager
    model = models_eager.make(name)
    config = _config(section)
    optimizer = None
    if sgd:
        del config["optimizer"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                      optimizer=optimizer)
    return engine


def _pair(name, steps, seq_of_step, backend="eager", compile_kwargs=None, dynamo_config=None):
    """Eager ZeRO-3, then DeepCompile, on the same model and data; the numbers (losses, the full gradients after every
    backward, parameters before training, after the first step and at the end) and what the runtime saw."""
    import deepspeed
    import torch
    from compare import full_params
    deepspeed.init_distributed(dist_backend="gloo")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the graph breaks the runtime's warnings name: this model's only
    out = {"grads": [], "eager_grads": []}
    sgd = backend == "inductor"
    eager = _initialize(name, None, sgd)
    out["eager_master_init"] = full_params(eager)
    out["eager_losses"] = [_train_one(eager, name, 0, seq_of_step, out["eager_grads"])]
    out["eager_master_after_first"] = full_params(eager)
    out["eager_losses"] += [_train_one(eager, name, step, seq_of_step, out["eager_grads"]) for step in range(1, steps)]
    eager_params = full_params(eager)
    eager.destroy()
    engine = _initialize(name, {"deepcompile": True}, sgd)
    engine.compile(backend=backend, compile_kwargs=compile_kwargs or {})
    runtime = runtime_of(engine, active_only=False)
    live = []
    torch._dynamo.utils.clear_compilation_metrics()  # the compiled engine's frames only
    with torch._dynamo.config.patch(**(dynamo_config or {})):
        losses = []
        for step in range(steps):
            losses.append(_train_one(engine, name, step, seq_of_step, out["grads"]))
            live.append(runtime.counters.gather.live_gathered_bytes)
            if step == 0:  # graphs compiled by the end of the first step, each direction counted (forward, backward)
                out["compiled_after_first"] = len(state_of(engine, active_only=False).stats.collective_orders)
                out["master_after_first"] = full_params(engine)
    out["frame_compiles"] = _frame_compiles()
    out["losses"] = losses
    params = full_params(engine)
    out["param_diff"] = max((params[k] - eager_params[k]).abs().max().item() for k in params)
    out["params_equal"] = all(torch.equal(params[k], eager_params[k]) for k in params)
    out["active"] = engine.is_deepcompile_active()
    out["graphs"] = state_of(engine, active_only=False).stats.graphs_compiled
    out["compiled"] = len(state_of(engine, active_only=False).stats.collective_orders)
    out["eager_gathers"] = runtime.counters.gather.eager_gathers
    out["eager_reasons"] = engine_report(engine)["eager_reasons"]
    out["gathers"] = runtime.counters.gather.gathers  # by the compiled graphs
    out["live_after_step"] = live
    engine.destroy()
    return out


def _fixed(step):
    return 12


def _varlen(step):
    return 6 + step  # a new length at every step


def _check_exact(r, steps):
    from compare import unequal
    assert r["active"], "the engine is not running DeepCompile"
    assert r["graphs"] >= 1 and r["gathers"] > 0, (r["graphs"], r["gathers"])  # compiled graphs gathered
    assert len(r["losses"]) == steps
    assert r["losses"] == r["eager_losses"], (r["losses"], r["eager_losses"])
    assert len(r["grads"]) == len(r["eager_grads"]) == steps
    for i, (g, eg) in enumerate(zip(r["grads"], r["eager_grads"])):
        assert not unequal(g, eg), f"backward {i}: gradients differ for {unequal(g, eg)}"
    assert r["params_equal"], r["param_diff"]
    assert r["live_after_step"] == [0] * steps, "gathered parameters outlived their step"
    assert r["losses"][-1] < r["losses"][0], "the model did not learn"


def _eager_pieces(steps):
    return {name: _pair(name, steps, _fixed) for name in ("gpt2_hooks", "loop_break", "disabled", "item_branch")}


# what each model's graph break makes dynamo say (gpt2_hooks: reasons in transformers' code, any)
EAGER_REASONS = {"loop_break": "torch._dynamo.graph_break()", "disabled": "torch.compiler.disable()",
                 "item_branch": "Tensor.item()"}


def test_eagerly_run_code_reads_real_parameters():
    """Frames dynamo skips, graph breaks in a loop, a disabled submodule and an .item() branch: exact parity,
    and the parameters those parts read were gathered on access (not computed as stand-ins)."""
    steps = 6
    for by_model in run_distributed(_eager_pieces, steps, timeout_s=500):
        for name, r in by_model.items():
            _check_exact(r, steps)
            # the rest ran compiled: the graphs gathered what they read (measured 2 or 3 graphs, 120 to 126 gathers)
            assert r["graphs"] >= 1 and r["gathers"] > 0, (name, r["graphs"], r["gathers"])
            # the .item() branch breaks the graph inside the loop over the blocks, as loop_break does: the model's
            # frame runs as Python and reads the embedding and the final norm there (measured 18 eager gathers in 6
            # steps, as loop_break)
            assert r["eager_gathers"] > 0, (name, r["eager_gathers"])
            # engine_report names dynamo's reason, as the warning did (the model's own break among them)
            assert r["eager_reasons"] and any(EAGER_REASONS.get(name, "") in reason for reason in r["eager_reasons"]), (
                name, r["eager_reasons"])


def _varlen_runs(steps):
    fixed = _pair("gpt2", steps, _fixed)
    varlen = _pair("gpt2", steps, _length_by_rank)
    return {"fixed": fixed, "varlen": varlen}


def test_new_sequence_length_every_step_compiles_at_most_twice():
    """12 lengths on a transformers GPT-2, and the two ranks' lengths differ at every step (a collator padding each
    rank's batch to its own longest sequence): each frame compiles a static graph, then one dynamic graph, and the
    ranks' collectives still match (exact parity, no hang)."""
    steps = 12
    for r in run_distributed(_varlen_runs, steps, timeout_s=500):
        for case in ("fixed", "varlen"):
            _check_exact(r[case], steps)
            assert r[case]["eager_gathers"] == 0, "a compiled-only model read parameters eagerly (guards?)"
        assert r["varlen"]["graphs"] <= 2 * r["fixed"]["graphs"], (r["varlen"]["graphs"], r["fixed"]["graphs"])
        # per frame, as dynamo's compilation metrics name them: a static, then a dynamic compile, never a third; at a
        # fixed length each frame compiles once
        print("frame compiles:", r["varlen"]["frame_compiles"])
        assert r["varlen"]["frame_compiles"] and max(r["varlen"]["frame_compiles"].values()) <= 2, r["varlen"]
        assert r["fixed"]["frame_compiles"] and max(r["fixed"]["frame_compiles"].values()) == 1, r["fixed"]
        assert max(r["varlen"]["frame_compiles"].values()) == 2, "no frame recompiled: the lengths did not vary"
        # at a fixed length nothing compiles after the first step, backward graphs included (stock DeepCompile's
        # users saw the backward recompiled every step), and every forward graph got exactly one backward
        fixed = r["fixed"]
        assert fixed["compiled"] == fixed["compiled_after_first"] == 2 * fixed["graphs"], fixed


def _length_by_rank(step):
    import torch.distributed as dist
    return 6 + step + 3 * dist.get_rank()  # a new length every step, and the two ranks' lengths differ


def _rank1_varies(step):
    import torch.distributed as dist
    return 12 if dist.get_rank() == 0 else 6 + step  # rank 0 compiles once; rank 1 a static, then a dynamic graph


def test_ranks_fed_different_lengths_train_exactly_without_hanging():
    """One rank recompiles where the other does not (lengths differing across ranks at every step are in the test
    above). Each rank's graphs gather the same parameters in the same order whatever their shapes, so the
    collectives still match: exact parity, no hang."""
    steps = 5
    results = run_distributed(_pair, "gpt2", steps, _rank1_varies, timeout_s=400)
    for r in results:
        _check_exact(r, steps)
        assert r["eager_gathers"] == 0
    graphs = [r["graphs"] for r in results]
    assert graphs[0] < graphs[1], graphs  # rank 1 compiled a graph rank 0 never needed, and they still agreed


def test_static_shapes_warn_that_ranks_may_pass_the_recompile_limit_apart(caplog):
    import logging
    from deepspeed.compile.engine_state import warn_static_shapes
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        assert not warn_static_shapes({}) and not warn_static_shapes({"dynamic": None})
        assert not warn_static_shapes({"dynamic": True})
        assert warn_static_shapes({"dynamic": False})
    finally:
        logger.removeHandler(caplog.handler)
    assert "recompile_limit" in caplog.text and "different lengths" in caplog.text


def _past_recompile_limit(steps):
    # static shapes and a small limit: from the third length on, dynamo runs the frames eagerly
    return _pair("gpt2", steps, _varlen, compile_kwargs={"dynamic": False}, dynamo_config={"recompile_limit": 2})


def test_past_the_recompile_limit_training_stays_exact():
    steps = 6
    for r in run_distributed(_past_recompile_limit, steps, timeout_s=400):
        _check_exact(r, steps)
        assert r["eager_gathers"] > 0, r


def _inductor_cases(steps):
    return {"varlen": _pair("gpt2", steps, _varlen, backend="inductor"),
            "loop_break": _pair("loop_break", steps, _fixed, backend="inductor")}


def test_inductor_eager_access_and_dynamic_shapes():
    from compare import check_fp32_close
    steps = 3  # three lengths: a static graph, then the dynamic one, then a reuse of it
    for by_case in run_distributed(_inductor_cases, steps, timeout_s=560):
        for case, r in by_case.items():
            assert r["active"] and r["live_after_step"] == [0] * steps, (case, r)
            assert len(r["grads"]) == len(r["eager_grads"]) == steps
            print(case, check_fp32_close(r))
            assert r["graphs"] >= 1 and r["gathers"] > 0, (case, r["graphs"], r["gathers"])
        # new lengths compile (a static, then a dynamic graph) and nothing reads a parameter eagerly; the graph break
        # in the loop runs the loop as Python, which gathers the parameters it reads on access (measured: varlen 4
        # graphs and no eager gather, loop_break 9 eager gathers in 3 steps)
        assert by_case["varlen"]["eager_gathers"] == 0, by_case["varlen"]["eager_gathers"]
        assert by_case["loop_break"]["eager_gathers"] > 0, by_case["loop_break"]["eager_gathers"]


def _without_compile():
    import deepspeed
    import models_eager
    deepspeed.init_distributed(dist_backend="gloo")
    losses = {}
    for section in (None, {"deepcompile": True}):
        model = models_eager.make("loop_break")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=_config(section))
        losses[section is not None] = _train(engine, "loop_break", 3, _fixed)
        assert not engine.is_deepcompile_active()
        engine.destroy()
    return losses


def test_deepcompile_without_engine_compile_trains_as_eager_zero3():
    for losses in run_distributed(_without_compile):
        assert losses[True] == losses[False]


def _standin_read():
    """A parameter held as an object (not read through its module) while the stand-ins are installed."""
    import deepspeed
    import torch
    import models_eager
    from deepspeed.compile.runtime.eager_access import StandinReadError
    from deepspeed.compile.z3_eager_fallback import deepcompile_z3_forward_context
    deepspeed.init_distributed(dist_backend="gloo")
    model = models_eager.make("loop_break")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=_config({"deepcompile": True}))
    engine.compile(backend="eager")
    idx, targets = models_eager.batch(0, torch.distributed.get_rank(), 12)
    engine.backward(engine(idx, targets))
    engine.step()  # one normal step: compiled
    held = engine.module.blocks[1].fc.weight  # read outside the forward: ZeRO-3's partitioned parameter
    runtime = runtime_of(engine, active_only=False)
    with deepcompile_z3_forward_context(engine):
        out = (torch.ones(2, 32) @ held).sum()  # computes with the stand-in, bypassing the module
    message = ""
    try:
        engine.backward(out)
    except StandinReadError as err:
        message = str(err)
    return {"nan": bool(torch.isnan(out).item()), "message": message,
            "live": runtime.counters.gather.live_gathered_bytes}


def test_computing_with_a_standin_raises_naming_the_parameter():
    for r in run_distributed(_standin_read):
        assert r["nan"], "a stand-in must never give plausible numbers"
        assert "'blocks.1.fc.weight'" in r["message"] and "stand-in" in r["message"], r["message"]


def _outside_calls():
    """A `transformers` Llama whose parameters are all sharded, one training step (between its forward and backward,
    under no_grad, the embedding called and the model called directly, as metrics code would), then what code does
    between steps with eager ZeRO-3's module hooks in mind: under no_grad, the embedding called on its own, the backbone
    without the head, and ``model.forward(...)``; then a training step on ``inputs_embeds`` computed by calling the
    embedding outside the engine (its gradient comes from that call), and a plain step after it. Last, with
    DeepCompile only, the embedding called inside ``GatheredParameters``: it reads the parameter held gathered."""
    import deepspeed
    import torch
    from models import tiny_llama
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    out = {}
    for deepcompile in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=_config({"deepcompile": True} if deepcompile else None))
        if deepcompile:
            engine.compile(backend="eager")
        ids = torch.randint(1, 256, (2, 12), generator=torch.Generator().manual_seed(rank))
        r = {"losses": []}

        def step(between=None, **inputs):
            loss = engine(labels=ids, **inputs).loss
            if between is not None:
                between()
            engine.backward(loss)
            engine.step()
            r["losses"].append(loss.item())

        def metrics():  # between a forward and its backward: the backward's state must survive them
            with torch.no_grad():
                r["between"] = (engine.module.get_input_embeddings()(ids), engine.module(input_ids=ids).logits)

        step(input_ids=ids, between=metrics)
        with torch.no_grad():
            r["embedding"] = engine.module.get_input_embeddings()(ids)
            r["backbone"] = engine.module.model(input_ids=ids).last_hidden_state
            r["forward"] = engine.module.forward(input_ids=ids, labels=ids).loss
        step(inputs_embeds=engine.module.get_input_embeddings()(ids))
        step(input_ids=ids)
        if deepcompile:  # eager ZeRO-3's own hooks release a parameter the user holds gathered after the call
            embedding = engine.module.get_input_embeddings()
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())), torch.no_grad():
                looked_up = embedding(ids)
                r["held"] = (embedding.weight.ds_status.name,
                             torch.equal(looked_up, torch.nn.functional.embedding(ids, embedding.weight)))
            r["active"] = engine.is_deepcompile_active()
            r["live_after"] = runtime_of(engine).counters.gather.live_gathered_bytes
            r["sharded"] = all(p.ds_status.name == "NOT_AVAILABLE" for p in engine.module.parameters())
        out[deepcompile] = r
        engine.destroy()
    return out


def test_submodules_called_outside_the_forward_run_as_in_eager_zero3():
    """Eager ZeRO-3 gathers a module's parameters whenever it is called; with its hooks off, such calls computed
    with ZeRO-3's empty parameters ("'weight' must be 2-D"). Now each runs as a forward of its own
    (``z3_outside.OutsideCalls``). Losses (the last one depends on the outside embedding's gradient) within
    1e-6 relative, and the outputs between steps within 1e-6 of their largest magnitude (measured 0 to 1e-7, and
    1e-7 and 3e-7): this model's joint graph sums some gradients in another order than eager autograd
    (test_trainer_style.py), and AdamW turns that round-off into parameters that differ in their last bits after
    the first step. The calls between the first forward and its backward, before any update, are equal."""
    import torch
    for r in run_distributed(_outside_calls, timeout_s=300):
        eager, compiled = r[False], r[True]
        assert compiled["active"] and compiled["sharded"] and compiled["live_after"] == 0, compiled
        assert compiled["held"] == ("AVAILABLE", True), compiled["held"]
        worst_loss = max(abs(a - b) / abs(a) for a, b in zip(eager["losses"], compiled["losses"]))
        assert worst_loss <= 1e-6, (eager["losses"], compiled["losses"])
        assert all(torch.equal(c, e) for c, e in zip(compiled["between"], eager["between"]))
        for what in ("embedding", "backbone", "forward"):
            worst = ((compiled[what] - eager[what]).abs().max() / eager[what].abs().max()).item()
            assert worst <= 1e-6, (what, worst)


def test_a_block_trampoline_break_is_named_as_regions_blocks():
    """Under ``regions: "blocks"`` each block's forward is a trampoline dynamo does not trace: the model's frame breaks
    there by design. Dynamo names that break "Skip calling `torch.compiler.disable()`d function", which told a user
    nothing (it was listed beside the real reason when something else made a frame run as Python, as the dict
    iteration of transformers' output capturing does for a ViT); the runtime names it as what it is."""
    import torch
    from torch._dynamo.utils import counters
    from deepspeed.compile.driver import regions
    from deepspeed.compile.runtime.eager_access import BLOCK_TRAMPOLINE_REASON, _dynamo_reasons
    torch._dynamo.reset()
    counters.clear()
    block = torch.nn.Linear(2, 2)
    trampoline = regions._trampoline(lambda module, x: module(x), block)

    @torch.compile(backend="eager")
    def model_frame(x):
        return trampoline(x * 2) + 1

    x = torch.ones(2)
    assert torch.equal(model_frame(x), block(x * 2) + 1)
    assert _dynamo_reasons() == [BLOCK_TRAMPOLINE_REASON], dict(counters["graph_break"])
    torch._dynamo.reset()
    counters.clear()
