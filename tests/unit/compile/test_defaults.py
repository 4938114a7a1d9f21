# SPDX-License-Identifier: Apache-2.0
"""DeepSpeed's default ZeRO-3 settings (no bucket sizes, default persistence threshold), as users run them.

Eager ZeRO-3 and DeepCompile train a ``transformers`` GPT-2 on the same data with a ds_config that sets nothing but
the stage, the batch and the optimizer. fp32 and the eager backend: losses and parameters must be equal (same
arithmetic, see test_eager_access.py). The runtime's reduce bucket must be sized to a quarter of the model, not to
the default ``reduce_bucket_size`` of 5e8 elements (2 GB of fp32), so that no per-step cost grows with it (the step times are
printed, not bounded: a timing bound on this noisy machine would be flaky; benchmarks/ measures them). A
``transformers`` Llama checks the gradients against plain autograd's (eager ZeRO-2's), which eager ZeRO-3 itself
departs from by round-off.
"""
from distributed import run_distributed
from deepspeed.compile.engine_state import runtime_of  # noqa: E402


def _default_config(section=None):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    if section is not None:
        config["compile"] = section
    return config


DEEPCOMPILE = (("eager", None), ("deepcompile", {"deepcompile": True}))


def _engines(model_name, backend="eager", zero_overrides=None, extra=None, sections=DEEPCOMPILE):
    """Eager ZeRO-3, then DeepCompile, on the same model at the default settings (plus the overrides): yields
    (name, engine) for each (name, compile section) of ``sections``; each engine is destroyed after its turn."""
    import deepspeed
    import torch
    import models_eager
    deepspeed.init_distributed(dist_backend="gloo")
    torch._dynamo.reset()
    for name, section in sections:
        model = models_eager.make(model_name)
        config = _default_config(section)
        config["zero_optimization"].update(zero_overrides or {})
        config.update(extra or {})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        if section is not None:
            engine.compile(backend=backend)
        yield name, engine
        engine.destroy()


def _gathered_after_forward(engine) -> int:
    """Bytes of the sharded parameters eager ZeRO-3 holds gathered between forward and backward: those it keeps for
    backward (by ``stage3_max_reuse_distance``, or because its prefetcher already walked past their backward use)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return sum(p.ds_numel * p.element_size() for p in engine.module.parameters()
               if not p.ds_persist and p.ds_status == ZeroParamStatus.AVAILABLE)


def _defaults(steps, zero_overrides=None, backend="eager"):
    import time
    import torch
    import models_eager
    from compare import full_params
    from deepspeed.compile.report import collective_orders, engine_report
    rank = torch.distributed.get_rank()
    out = {}
    for name, engine in _engines("gpt2", backend, zero_overrides):
        losses, times = [], []
        for step in range(steps):
            idx, _ = models_eager.batch(step, rank, 16)
            start = time.perf_counter()
            loss = engine(input_ids=idx, labels=idx).loss
            if name == "eager" and step == steps - 1:
                out["eager_kept"] = _gathered_after_forward(engine)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        result = {"losses": losses, "params": full_params(engine), "step_s": sorted(times[2:])[len(times[2:]) // 2]}
        runtime = runtime_of(engine, active_only=False)
        if runtime is not None:
            result["bucket_numel"] = max(b.numel() for bufs in runtime.reducer.buffers.values() for b in bufs)
            world_size = runtime.transport.world_size
            result["partition_numel"] = sum(p.partition_numel() for p in runtime.params.values()) * world_size
            result["active"] = engine.is_deepcompile_active()
            result["gathers"] = runtime.counters.gather.gathers
            result["collectives"] = runtime.counters.gather.allgather_collectives
            # the runs gathered, in first-use order, each with whether its collective starts the next run's
            result["plans"] = [(text, bool(plan.next)) for text, plan in runtime.runs.plans.items()]
            result["persistent"] = len(runtime.persistent)
            result["orders"] = collective_orders(engine)  # per compiled graph: its gathers and reduces, in order
            report = engine_report(engine) or {}
            result["kept"] = report.get("kept_gathered_bytes")
            result["graphs"] = report.get("graphs_compiled", 0)
            result["reduces"] = report.get("reduces", 0)
            result["reduce_collectives"] = report.get("reduce_collectives", 0)
            result["sums_in_place"] = report.get("sums_in_place", 0)
            host = runtime.transport.host  # shared memory where the ranks share it (compile.host_comm "auto")
            result["host_reduce_collectives"] = None if host is None else host.reduce.started
            result["sharded_bytes"] = {ds_id: p.ds_numel * p.element_size() for ds_id, p in runtime.sharded.items()}
        out[name] = result
    out["params_equal"] = all(torch.equal(out["eager"]["params"][k], out["deepcompile"]["params"][k])
                              for k in out["eager"]["params"])
    for r in (out["eager"], out["deepcompile"]):
        del r["params"]
    return out


def test_default_settings_train_exactly_with_a_bucket_of_a_quarter_of_the_model():
    steps = 8
    for r in run_distributed(_defaults, steps, timeout_s=400):
        dc = r["deepcompile"]
        assert dc["active"]
        assert dc["losses"] == r["eager"]["losses"], (dc["losses"], r["eager"]["losses"])
        assert r["params_equal"]
        # the bucket holds at most a quarter of every trained parameter's partition on every rank, not 5e8 elements
        assert 0 < dc["bucket_numel"] <= dc["partition_numel"] // 4, dc
        # every parameter of this model is under the default persistence threshold (1e5 elements): as in eager
        # ZeRO-3 they stay gathered across steps, and the graphs gather none of them
        assert dc["persistent"] > 0 and dc["gathers"] == 0, dc
        # so what shows that DeepCompile ran is its graphs and its reduces (a persistent parameter's gradient comes out
        # of the compiled backward and the runtime reduce-scatters it). One forward graph, the loss in it: GPT-2's
        # loss function logs that its loss_type is unset (warning_once), which broke the forward in two until
        # DeepCompile's forward told dynamo to ignore that call (integrations/ds_checkpointing.py)
        assert dc["graphs"] == 1 and dc["reduces"] > 0, dc
        # the tied embedding's two gradients are summed into one of them (the same values as eager ZeRO-3's, above)
        assert dc["sums_in_place"] > 0, dc
        # through shared memory each bucket's reduction is one collective of the channel: its slots are sized by every
        # trained parameter, persistent ones included (sized by the sharded ones alone, none here, a bucket went
        # through in chunks of 64 bytes, tens of thousands of collectives a step)
        if dc["host_reduce_collectives"] is not None:
            assert dc["host_reduce_collectives"] == dc["reduce_collectives"] > 0, dc
        print(f"default settings, median step: DeepCompile {dc['step_s'] * 1e3:.1f} ms, "
              f"eager ZeRO-3 {r['eager']['step_s'] * 1e3:.1f} ms")


def _llama_first_gradients():
    """First-backward gradients of a ``transformers`` Llama at the default settings: eager ZeRO-2 (plain autograd
    arithmetic on replicated parameters), eager ZeRO-3, and DeepCompile ZeRO-3 whole-model and block by block."""
    import deepspeed
    import torch
    import models_eager
    from compare import full_grads
    deepspeed.init_distributed(dist_backend="gloo")
    idx, _ = models_eager.batch(0, torch.distributed.get_rank(), 16)
    out = {}
    for name, stage, section in (("zero2", 2, None), ("zero3", 3, None), ("model", 3, {"deepcompile": True}),
                                 ("blocks", 3, {"deepcompile": True, "regions": "blocks"})):
        torch._dynamo.reset()
        model = models_eager.make("llama")
        config = _default_config(section)
        config["zero_optimization"]["stage"] = stage
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        if section is not None:
            engine.compile(backend="eager")
        loss = engine(input_ids=idx, labels=idx).loss
        engine.backward(loss)
        out[name] = {"loss": loss.item(), "grads": full_grads(engine)}
        engine.destroy()
    return out


def test_transformers_llama_gradients_are_plain_autograds():
    """On a ``transformers`` Llama, eager ZeRO-3 departs from plain autograd in the last bits of the layers' attention
    backward (its gradients differ from eager ZeRO-2's by round-off, about 1e-8 absolute; its module hooks around
    the attention are the likely cause, not traced further), so the exact reference is eager ZeRO-2, which computes
    with plain autograd on replicated parameters and reduces over 2 ranks exactly (a sum of two, halved): DeepCompile
    ZeRO-3, whole model and block by block, gives its gradients bitwise. Against eager ZeRO-3 they agree to
    round-off (1e-5 of each gradient's largest element)."""
    import torch
    from compare import unequal
    for r in run_distributed(_llama_first_gradients, timeout_s=400):
        reference = r["zero2"]["grads"]
        for name in ("model", "blocks"):
            assert r[name]["loss"] == r["zero2"]["loss"] == r["zero3"]["loss"], (name, r[name]["loss"])
            assert not unequal(r[name]["grads"], reference), (name, unequal(r[name]["grads"], reference))
            for key, grad in r[name]["grads"].items():
                scale = r["zero3"]["grads"][key].abs().max().item()
                assert torch.allclose(grad, r["zero3"]["grads"][key], rtol=0, atol=1e-5 * scale), key


def test_coalesced_async_gathers_same_order_on_every_rank():
    """Nothing persistent, a prefetch bucket of 2e4 elements (at the default 5e7 elements each graph of this model is
    one run): consecutive gathers share one collective up to the bucket, and each run's collective starts the next
    run's ahead. The runs, and which starts which, are a function of the graph: identical on both ranks (a
    difference would hang or mix up collectives), and so is each compiled graph's order of gathers and reduces.
    Bitwise equal to eager ZeRO-3, with fewer collectives than parameter gathers. This test runs the eager backend;
    under inductor, coalesced runs started ahead and issued in the same order on both ranks are tested by
    test_pipeline.py's ``test_collective_order_is_the_same_on_every_rank[inductor]`` (and on a ``transformers`` Llama
    by test_trainer_style.py's bf16 inductor test), inductor's parity with eager ZeRO-3 by test_inductor.py."""
    overrides = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 20000}
    ranks = run_distributed(_defaults, 3, overrides, timeout_s=400)
    assert ranks[0]["deepcompile"]["plans"] == ranks[1]["deepcompile"]["plans"]
    orders = [r["deepcompile"]["orders"] for r in ranks]
    assert orders[0] == orders[1] and len(orders[0]) >= 2 and any(orders[0])
    assert any(plan[1] for plan in ranks[0]["deepcompile"]["plans"]), "no run starts another ahead"
    for r in ranks:
        dc, eager = r["deepcompile"], r["eager"]
        assert dc["losses"] == eager["losses"] and r["params_equal"], (dc["losses"], eager["losses"])
        assert dc["persistent"] == 0 and 0 < dc["collectives"] < dc["gathers"], dc


PRECISIONS = {  # how gradients travel in eager ZeRO-3 (``get_param_comm_dtype``)
    "bf16": {"bf16": {"enabled": True}},  # every gradient in bf16
    # every gradient in fp32 (DeepSpeed's option for reducing 16-bit gradients at full precision)
    "bf16, fp32 communication": {"bf16": {"enabled": True}, "communication_data_type": "fp32"},
    # lower-precision-safe modules' (nn.Linear here) in bf16, the others in fp32. Last: DeepSpeed's flag that
    # torch_autocast is on is a module global (``torch_autocast.TORCH_AUTOCAST_INITIALIZED``) that nothing resets, so
    # every later engine in the process, eager ZeRO-3's too, would take each parameter's autocast dtype and ignore
    # communication_data_type (measured: the fp32 case then moved bf16's bytes)
    "autocast": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
}


def _reduce_bytes(steps):
    import deepspeed
    import torch
    import models_eager
    from collectives import count_reductions
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    out = {}
    for precision, extra in PRECISIONS.items():
        out[precision] = {}
        # every parameter sharded
        # DeepCompile's reduces counted where they meet the process group (host_comm "gloo"), and through shared
        # memory (its default on one host: every test machine's, machine.py), where only engine_report counts them
        sections = (DEEPCOMPILE[0], ("deepcompile", {"deepcompile": True, "host_comm": "gloo"}),
                    ("deepcompile-shm", {"deepcompile": True, "host_comm": "shm"}))
        for name, engine in _engines("plain", zero_overrides={"stage3_param_persistence_threshold": 0}, extra=extra,
                                     sections=sections):
            idx, targets = models_eager.batch(0, rank, 12)
            engine.backward(engine(idx, targets))  # the first step compiles: count the steps after it
            engine.step()
            norms = []
            runtime = runtime_of(engine)
            agreements = 0 if runtime is None else runtime.peers.agreements
            with count_reductions() as counts:
                for step in range(1, steps + 1):
                    idx, targets = models_eager.batch(step, rank, 12)
                    engine.backward(engine(idx, targets))
                    engine.step()
                    norms.append(float(engine.get_global_grad_norm()))
            result = out[precision][name] = {"bytes": counts.reduce_scatter_bytes + counts.all_reduce_bytes,
                                             "reduce_scatter_bytes": counts.reduce_scatter_bytes, "grad_norms": norms}
            if runtime is not None:  # each graph's agreement: a float32 a rank, all-reduced (runtime/agreement.py)
                made = runtime.peers.agreements - agreements
                result["agreement_bytes"] = made * 4 * torch.distributed.get_world_size()
            if name != "eager":
                from deepspeed.compile.report import engine_report
                report = engine_report(engine) or {}
                result["active"] = engine.is_deepcompile_active()
                result.update({key: report.get(key) for key in ("reduces", "reduce_bytes", "host_comm")})
    return out


def test_gradients_travel_in_each_parameters_comm_dtype():
    """Eager ZeRO-3 reduces each gradient in its parameter's communication dtype: under torch_autocast bf16 for
    lower-precision-safe modules and fp32 for the others, under bf16 in bf16, or in ``communication_data_type``
    when set. DeepCompile moves exactly the same reduction bytes, besides the all-reduce that starts each forward graph
    (``runtime/agreement.py``), from its own reduces (not from eager ZeRO-3's hooks
    after a fallback): reduce-scatter inputs and all-reduced tensors together, since on gloo DeepCompile all-reduces
    each bucket (what gloo's reduce-scatter runs inside), and both all-reduce the same gradient-norm scalars. fp32 communication of bf16 gradients moves twice the bytes of bf16's on both. The
    gradient norms agree within bf16's resolution (2^-8 relative: the compiled bf16 graphs round differently from
    eager ZeRO-3's modules; a gradient reduced at the wrong scale or reinterpreted in another dtype is off by far
    more)."""
    from machine import require_shared_memory
    require_shared_memory()
    for r in run_distributed(_reduce_bytes, 3):
        for precision, by_engine in r.items():
            dc, eager = by_engine["deepcompile"], by_engine["eager"]
            assert dc["active"] and dc["reduces"] > 0, (precision, dc)
            assert dc["bytes"] - dc["agreement_bytes"] == eager["bytes"] > 0, (precision, dc, eager["bytes"])
            assert dc["host_comm"] == "gloo", dc
            # through shared memory: the same gradient bytes, none of them through the process group
            shm = by_engine["deepcompile-shm"]
            assert shm["active"] and shm["host_comm"] == "shm", shm
            assert shm["reduce_bytes"] == dc["reduce_bytes"] > 0, (precision, shm, dc)
            # through the process group: the norms' scalars only
            assert 0 < shm["bytes"] * 100 < dc["bytes"], (precision, shm["bytes"], dc["bytes"])
            for run in (dc, shm):
                worst = max(abs(a - b) / b for a, b in zip(run["grad_norms"], eager["grad_norms"]))
                assert worst <= 2 ** -8, (precision, run["grad_norms"], eager["grad_norms"])
        # (eager ZeRO-3's gradients all travel in reduce-scatters; its all-reduces are the norm's scalars)
        assert r["bf16, fp32 communication"]["eager"]["reduce_scatter_bytes"] == \
            2 * r["bf16"]["eager"]["reduce_scatter_bytes"] > 0, r


KEEP_SETTINGS = {  # nothing persistent in each
    "defaults": {},
    "reuse 0": {"stage3_max_reuse_distance": 0},  # eager ZeRO-3's prefetcher (1e9 live elements) still keeps all
    "reuse 0, live 40000": {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 40000},
    "reuse 0, no prefetch": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
}


def _keep_settings(steps):
    return {name: _defaults(steps, {"stage3_param_persistence_threshold": 0, **zero})
            for name, zero in KEEP_SETTINGS.items()}


def test_parameters_stay_gathered_for_backward_where_eager_zero3_keeps_them():
    """Which parameters stay gathered from forward to backward is what eager ZeRO-3 keeps, in bytes, under each
    setting: at the default ``stage3_max_reuse_distance`` (1e9 elements) every parameter, and DeepCompile's backward
    gathers nothing; at 0 those its prefetcher has walked past when forward ends (all of this small model with the
    default 1e9 live elements, some within 40000, none without prefetch), where backward gathers the rest again
    (min-cut's recompute). Eager ZeRO-3 also holds, module by module, parameters backward never reads (biases, the
    position embedding), which DeepCompile does not keep. Every setting is bitwise eager ZeRO-3's in fp32 with the
    eager backend."""
    for r in run_distributed(_keep_settings, 3, timeout_s=500):
        # the backward graphs' collectives (a backward graph is the one that reduces), as (op, ds_id)
        backward = {name: [order for order in r[name]["deepcompile"]["orders"] if any(op == "reduce" for op, _ in order)]
                    for name in KEEP_SETTINGS}
        # without prefetch nothing is kept: backward gathers every parameter it reads
        sharded = r["reuse 0, no prefetch"]["deepcompile"]["sharded_bytes"]
        read = {ds_id for order in backward["reuse 0, no prefetch"] for op, ds_id in order if op == "gather"}
        unread = sum(size for ds_id, size in sharded.items() if ds_id not in read)
        assert read and unread > 0, (read, sharded)
        for name in KEEP_SETTINGS:
            dc, eager = r[name]["deepcompile"], r[name]["eager"]
            assert dc["active"] and dc["persistent"] == 0, dc
            assert dc["losses"] == eager["losses"] and r[name]["params_equal"], (name, dc, eager)
            # what eager ZeRO-3 holds gathered after forward: DeepCompile's kept bytes, and at most the unread ones
            assert dc["kept"] <= r[name]["eager_kept"] <= dc["kept"] + unread, (name, dc["kept"], r[name]["eager_kept"])
        backward = {name: [[op for op, _ in order] for order in orders] for name, orders in backward.items()}
        kept = {name: r[name]["deepcompile"]["kept"] for name in KEEP_SETTINGS}
        for name in ("defaults", "reuse 0"):
            assert backward[name] and not any("gather" in ops for ops in backward[name]), (name, backward[name])
        for name in ("reuse 0, live 40000", "reuse 0, no prefetch"):
            assert any("gather" in ops for ops in backward[name]), (name, backward[name])
        assert kept["defaults"] == kept["reuse 0"] > kept["reuse 0, live 40000"] > kept["reuse 0, no prefetch"] == 0
        assert r["defaults"]["deepcompile"]["gathers"] < r["reuse 0, no prefetch"]["deepcompile"]["gathers"], r
