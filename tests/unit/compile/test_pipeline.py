# SPDX-License-Identifier: Apache-2.0
"""The ZeRO-3 pipeline end to end on 2 gloo ranks, against eager ZeRO-3 trained in the same process.

Tolerances:
- fp32, eager backend: the compiled graphs do the same arithmetic in the same order as eager ZeRO-3 (the
  gather, the pre-divided reduce-scatter and the optimizer are bitwise the same), so every loss, every gradient
  (gathered from the ZeRO-3 partitions after every backward), every parameter and buffer must
  be bitwise equal: ``==`` and ``torch.equal``, no tolerance.
- bf16 / autocast(bf16): eager ZeRO-3 and the compiled graph round differently (see ``compare.py``), so
  - gradients at step 0 (same parameters on both sides), and under SGD the fp32 master weights' first update
    (lr times the gradient the optimizer applied), may differ norm-wise, per parameter, by at most twice eager
    ZeRO-3's own bf16 error on that parameter's gradient against fp32, and never less than twice one bf16 rounding
    (``compare.bf16_grad_bounds``); a wrong gradient scale differs by 50 % or more;
  - the loss of step 0 within one bf16 unit round-off, 2^-8 relative; the losses of all 10 steps within 1e-2
    (the parameters have drifted apart by then, see below; measured 3e-3 at most).
  Later parameters are not compared: 10 steps compound the rounding differences into a drift of 10-25 % of
  the distance moved, which bounds nothing.
Every test also checks that training makes the loss fall (the data is learnable, see ``models.py``).
"""
import os

import pytest
import torch

from distributed import run_distributed
from deepspeed.compile.engine_state import runtime_of  # noqa: E402
from deepspeed.compile.report import collective_orders  # noqa: E402

STEPS = 10


def _pair(model, dtype, section, steps=STEPS, grad_accum=1, optimizer="adamw", config=None):
    """Gradients are compared after every backward."""
    from compare import run_pair
    return run_pair(model, steps, dtype=dtype, compile_section=section, grad_accum=grad_accum, optimizer=optimizer,
                    grad_steps=None, **(config or {}))


def _check_common(r, steps=STEPS, grad_accum=1, fall_by=0.01):
    """DeepCompile ran, released what it gathered, and training made the loss fall (mean of the last 2 steps
    against the first 2) by ``fall_by`` relative: 1 % in 10 AdamW steps; the GPT learns slowly under SGD."""
    from compare import assert_ran_compiled, loss_fell
    assert_ran_compiled(r)
    assert len(r["losses"]) == steps * grad_accum
    assert r["live_after_step"] == [0] * steps, "gathered parameters outlived their step"
    assert loss_fell(r["losses"], window=2 * grad_accum, by=fall_by), r["losses"]


# the core cases run on both transports (compile.host_comm): "auto" takes shared memory where the ranks share a host,
# "gloo" the process group, which multi-host jobs take and the NCCL path shares
@pytest.mark.parametrize("model,optimizer,host_comm", [("mlp", "adamw", "auto"), ("gpt", "adamw", "auto"),
                                                       ("gpt", "adamw", "gloo"), ("gpt", "sgd", "auto"),
                                                       ("frozen", "adamw", "auto")])
def test_fp32_matches_eager_zero3(model, optimizer, host_comm):
    from compare import assert_bitwise_equal, assert_transport
    from models import make_model
    initial = dict(make_model(model).named_parameters())
    for r in run_distributed(_pair, model, "fp32", {"host_comm": host_comm}, STEPS, 1, optimizer):
        _check_common(r, fall_by=0.01 if optimizer == "adamw" else 0.002)
        assert_transport(r, host_comm)
        assert_bitwise_equal(r)
        frozen = {name for name, p in initial.items() if not p.requires_grad}
        for grads in r["grads"]:
            assert {name for name, g in grads.items() if g is None} == frozen
        for name in frozen:
            assert torch.equal(r["params"][name], initial[name].detach()), f"frozen {name} changed"
        if model == "gpt":  # tied input/output embedding: one parameter, one gradient
            # (never None), reduced once a backward, as every parameter: measured 280 reduces, 28 parameters in 10 steps
            assert all(grads["tok.weight"] is not None for grads in r["grads"]), r["grads"]
            assert r["counters"]["reduces"] == STEPS * len(initial), (r["counters"]["reduces"], len(initial))
            assert r["saved"]["param_bytes"] == 0, r["saved"]
            assert r["saved"]["other_bytes"] > 0


def _bf16_pairs(dtype, section, transports):
    """The compiled engine on each of ``transports`` (compile.host_comm) and eager ZeRO-3, all in ``dtype`` under SGD,
    and eager ZeRO-3's fp32 gradient at step 0: one eager run for every compiled one."""
    from compare import run_compiled, run_eager
    eager = run_eager("gpt", STEPS, dtype=dtype, optimizer="sgd", grad_steps=1)
    fp32_grads = run_eager("gpt", 1, optimizer="sgd", grad_steps=1)["eager_grads"]
    return {host_comm: {**eager, "fp32_grads": fp32_grads,
                        **run_compiled("gpt", STEPS, dtype=dtype, optimizer="sgd", grad_steps=1,
                                       compile_section={**section, "host_comm": host_comm})}
            for host_comm in transports}


# autocast with the default partitioner too: test_partitioner_and_fused_cast_effects compares its losses only
@pytest.mark.parametrize("dtype, section, transports", [("autocast", {}, ("auto", "gloo")),
                                                        ("bf16", {}, ("auto", "gloo")),
                                                        ("autocast", {"partitioner": "default"}, ("auto", ))],
                         ids=["autocast", "bf16", "autocast-default-partition"])
def test_bf16_matches_eager_zero3(dtype, section, transports):
    """Each transport against eager ZeRO-3 within the stated bounds, and the two transports against each other bit for
    bit: the same graphs, gathers that copy bits, and a reduction of 2 terms, which rounds once either way."""
    from compare import (assert_ran_compiled, assert_same_training, assert_transport, check_bf16_against_eager,
                         loss_fell)
    for by_transport in run_distributed(_bf16_pairs, dtype, section, transports):
        for host_comm, r in by_transport.items():
            assert_ran_compiled(r)
            assert_transport(r, host_comm)
            assert r["live_after_step"] == [0] * STEPS
            assert loss_fell(r["losses"], by=0.002), r["losses"]
            measured = check_bf16_against_eager(r, dtype)
            print(f"{dtype} ({host_comm}): " + ", ".join(f"{k} {v:.3g}" for k, v in measured.items()))
            # the default partition saves them
            assert (r["saved"]["param_bytes"] == 0) == (section.get("partitioner") != "default"), r["saved"]
            if dtype == "bf16":  # the bf16 parameters are the fp32 master weights rounded, on both engines
                for key in ("", "eager_"):
                    params, master = r[key + "params"], r[key + "master"]
                    assert all(torch.equal(params[k], master[k].bfloat16().float()) for k in params), key
        if len(transports) == 2:
            assert_same_training(by_transport["auto"], by_transport["gloo"])


def _traffic_and_saved(model):
    from compare import run_pair
    out = {}
    for name, dtype, section in [("fp32", "fp32", {}), ("autocast", "autocast", {}),
                                 ("autocast_unfused", "autocast", {"fused_cast": False}),
                                 ("default", "fp32", {"partitioner": "default"}),
                                 ("autocast_default", "autocast", {"partitioner": "default"})]:
        r = run_pair(model, 2, dtype=dtype, compile_section=section)
        out[name] = (r["counters"], r["saved"], r["losses"], r["live_after_step"], r["eager_losses"])
    return out


def test_partitioner_and_fused_cast_effects():
    from compare import BF16_UNIT_ROUNDOFF, max_rel_diff
    for out in run_distributed(_traffic_and_saved, "gpt", timeout_s=400):
        # min-cut with tags saves no parameter-derived tensor; the default partition does (the tags matter)
        assert out["fp32"][1]["param_bytes"] == 0 and out["autocast"][1]["param_bytes"] == 0
        assert out["default"][1]["param_bytes"] > 0 and out["autocast_default"][1]["param_bytes"] > 0
        # ... and backward gathers again instead
        assert out["fp32"][0]["gathers"] > out["default"][0]["gathers"]
        # the fused cast sends bf16 shards: the parameters autocast downcasts move half the bytes of gathering
        # fp32 and casting after; the others (norms, embeddings) are gathered in fp32 either way
        fused = out["autocast"][0]["allgather_bytes_by_dtype"]
        assert fused["torch.bfloat16"] > 0
        assert fused["torch.float32"] + 2 * fused["torch.bfloat16"] == out["autocast_unfused"][0]["allgather_bytes"]
        assert out["autocast_unfused"][0]["allgather_bytes"] == out["fp32"][0]["allgather_bytes"]
        assert out["autocast"][2] == out["autocast_unfused"][2], "fusing the cast changed the numbers"
        for name, (counters, _, losses, live, eager_losses) in out.items():
            assert live == [0, 0]
            if name.startswith("autocast"):  # see the module docstring
                assert max_rel_diff(eager_losses[:1], losses[:1]) <= BF16_UNIT_ROUNDOFF, (name, eager_losses, losses)
                assert max_rel_diff(eager_losses, losses) <= 1e-2, (name, eager_losses, losses)
            else:
                assert losses == eager_losses, (name, eager_losses, losses)


def _pairs_on_both_transports(model, steps, grad_accum):
    """:func:`_pair` in fp32 on each transport (compile.host_comm "auto" and "gloo"), one eager ZeRO-3 run for both."""
    from compare import run_compiled, run_eager
    common = dict(grad_accum=grad_accum, grad_steps=None)
    eager = run_eager(model, steps, **common)
    return {host_comm: {**eager, **run_compiled(model, steps, compile_section={"host_comm": host_comm}, **common)}
            for host_comm in ("auto", "gloo")}


def test_gradient_accumulation_matches_eager_zero3():
    # gradients compared after each of the 10 backwards: the accumulated gradient's scale; both transports in one launch
    from compare import assert_bitwise_equal, assert_transport
    for by_transport in run_distributed(_pairs_on_both_transports, "gpt", 5, 2):
        for host_comm, r in by_transport.items():
            _check_common(r, steps=5, grad_accum=2)
            assert_transport(r, host_comm)
            assert len(r["grads"]) == 10
            assert_bitwise_equal(r)
            # the second micro-step's gradient is the sum of both: not equal to the first
            assert not torch.equal(r["grads"][0]["tok.weight"], r["grads"][1]["tok.weight"])
            # the allocator's free memory goes back to the OS before each optimizer step, not after every backward
            assert r["host_memory_release"] and r["host_memory_releases"] == 5, r["host_memory_releases"]


def test_graph_break_trains_correctly():
    from compare import assert_bitwise_equal
    for r in run_distributed(_pair, "branchy", "fp32", {}):
        _check_common(r)
        assert r["graphs"] >= 2, "the model was expected to break into several graphs"
        assert_bitwise_equal(r)


def _checkpoint_round_trip(ckpt_root, section):
    from compare import full_params, unequal
    from models import ds_config
    from training import make_engine, train
    torch._dynamo.reset()  # each engine of a launch compiles from dynamo's empty caches
    engine = make_engine("gpt", ds_config(3, section))
    compile_kwargs = {"backend": "eager"} if section else None
    train(engine, "gpt", 3, compile_kwargs=compile_kwargs)
    tag = "compiled" if section else "eager"
    engine.save_checkpoint(ckpt_root, tag=tag)
    saved = full_params(engine)
    after_save = train(engine, "gpt", 3, first_step=3)
    engine.load_checkpoint(ckpt_root, tag=tag)
    restored = unequal(saved, full_params(engine))
    active_after_load = engine.is_deepcompile_active()
    gathers_before = runtime_of(engine, active_only=False)
    gathers_before = gathers_before.counters.gather.gathers if gathers_before is not None else None
    after_load = train(engine, "gpt", 3, first_step=3)
    runtime = runtime_of(engine, active_only=False)
    gathered_after_load = None if runtime is None else runtime.counters.gather.gathers - gathers_before
    from compare import shm_unavailable
    transport = None if runtime is None else {"host_comm": runtime.host_comm, "shm_unavailable": shm_unavailable(engine)}
    engine.destroy()
    return after_save, after_load, restored, active_after_load, gathered_after_load, transport


def _checkpoint_round_trips(ckpt_root):
    """:func:`_checkpoint_round_trip` of the compiled engine on each transport in turn, in one launch."""
    return [_checkpoint_round_trip(ckpt_root, {"deepcompile": True, "host_comm": host_comm})
            for host_comm in ("auto", "gloo")]


def test_checkpoint_round_trip_matches_eager_zero3(tmp_path):
    eager = run_distributed(_checkpoint_round_trip, str(tmp_path), None)
    by_transport = run_distributed(_checkpoint_round_trips, str(tmp_path))
    assert os.path.isdir(tmp_path / "compiled")
    from compare import assert_transport
    for (e_save, e_load, e_restored, *_), compiled in zip(eager, by_transport):
        for host_comm, (c_save, c_load, c_restored, c_active, c_gathered, c_transport) in zip(("auto", "gloo"),
                                                                                              compiled):
            assert_transport(c_transport, host_comm)
            assert e_restored == [] and c_restored == [], (e_restored, c_restored)
            assert c_active, "DeepCompile is no longer active after load_checkpoint"
            assert c_gathered > 0, "training after load_checkpoint did not run the compiled graphs"
            assert c_save == c_load, "training after load differs from training after save"
            assert c_load == e_load, "training after load differs from eager ZeRO-3's"


def _failed_compile_falls_back():
    import torch
    from deepspeed.compile.graph import rewrite
    from models import ds_config, make_batch
    from training import make_engine, train

    eager = make_engine("gpt", ds_config(3))
    eager_losses = train(eager, "gpt", 3)
    eager.destroy()

    def broken_pass(gm, **kwargs):
        raise RuntimeError("injected pass failure")

    rewrite.insert_releases_pass = broken_pass
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True}))
    engine.compile(backend="eager")
    hooks_while_compiled = len(engine.optimizer._grad_acc_hooks)
    try:
        engine(*make_batch("gpt", 0, torch.distributed.get_rank()))
        raised = None
    except Exception as err:
        raised = str(err)
    report = (hooks_while_compiled, len(engine.optimizer._grad_acc_hooks), engine.is_deepcompile_active(), raised)
    return report, eager_losses, train(engine, "gpt", 3)


def test_failed_compile_restores_eager_zero3():
    for (hooks_on, hooks_after, active, raised), eager_losses, losses in run_distributed(_failed_compile_falls_back):
        assert hooks_on == 0 and hooks_after > 0, "eager ZeRO-3 gradient hooks were not switched off/on"
        assert raised is not None and "injected pass failure" in raised
        assert not active
        assert losses == eager_losses  # uncompiled eager ZeRO-3 from the first step on: the same arithmetic


def _failed_backward_compile():
    import torch
    from deepspeed.compile.graph import rewrite
    from models import ds_config, make_batch
    from training import make_engine, train

    eager = make_engine("gpt", ds_config(3))
    eager_losses = train(eager, "gpt", 3, first_step=1)  # the reference skips step 0, as the failed step is skipped
    eager.destroy()

    def broken_pass(gm, **kwargs):
        raise RuntimeError("injected backward pass failure")

    rewrite.insert_reduces_pass = broken_pass  # runs only when AOTAutograd compiles backward, lazily
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True}))
    engine.compile(backend="eager")
    loss = engine(*make_batch("gpt", 0, torch.distributed.get_rank()))  # the forward compiles and runs
    try:
        engine.backward(loss)
        raised = None
    except RuntimeError as err:
        raised = str(err)
    active = engine.is_deepcompile_active()
    return raised, active, eager_losses, train(engine, "gpt", 3, first_step=1)


def test_failed_backward_compile_is_a_clear_error_then_eager_zero3():
    """AOTAutograd compiles backward inside the first backward(), past the backend's fallback: the error names the
    backward compile and the cause, and the next steps run as eager ZeRO-3 (same losses as eager ZeRO-3 that
    skipped the failed step)."""
    for raised, active, eager_losses, losses in run_distributed(_failed_backward_compile):
        assert raised is not None and "compiling a backward graph failed" in raised, raised
        assert "injected backward pass failure" in raised and "engine.step()" in raised, raised
        assert not active
        assert losses == eager_losses


def _ops_ran(fn):
    """``fn()``'s result and how many times each op ran in it, as torch's profiler names them (a spy that patches
    nothing): the native gather is ``dsc_native::cast_all_gather``, a gather from Python ``c10d::_allgather_base_``,
    one through shared memory neither. An exception ``fn`` raises is returned in place of its result."""
    from collections import Counter
    from torch.profiler import ProfilerActivity, profile
    result = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001  (the caller checks what it is)
            result = err
    return result, Counter(event.name for event in prof.events())


def _native_vs_python():
    from deepspeed.compile.native.gather import OP_NAME
    from deepspeed.compile.report import engine_report, reset_counters
    from models import ds_config
    from training import make_engine, train
    out = {}
    for mode in ("native", "python"):
        # on the process group: through shared memory (host_comm "auto" on one host) neither function would run
        engine = make_engine("gpt", ds_config(3, {"deepcompile": True, "native_op": mode, "host_comm": "gloo"},
                                              "autocast"))
        losses = train(engine, "gpt", 3, compile_kwargs={"backend": "eager"})
        reset_counters(engine)  # the last step's counters, beside the ops the profiler saw run in it
        last, ran = _ops_ran(lambda: train(engine, "gpt", 1, first_step=3))
        report = engine_report(engine)
        out[mode] = {"losses": losses + last, "ran": {"native": ran[OP_NAME], "c10d": ran["c10d::_allgather_base_"]},
                     **{key: report[key] for key in ("gather_path", "gather_collectives_by_path", "gather_op_loaded",
                                                     "gather_seconds", "gathers", "allgather_collectives",
                                                     "allgather_bytes_by_dtype", "host_comm")}}
        engine.destroy()
    return out


def test_native_gather_trains_like_python_gather():
    """The native op and the Python gather, each on the process group, train alike; each ran (the profiler counted
    its op once per collective of the step) and ``engine_report`` names the path that ran."""
    for out in run_distributed(_native_vs_python):
        native, python = out["native"], out["python"]
        for mode, r in out.items():
            assert r["host_comm"] == "gloo" and r["gather_op_loaded"] == mode, r
            assert r["allgather_collectives"] > 0 and r["gather_path"] == mode, r
            assert r["gather_collectives_by_path"] == {mode: r["allgather_collectives"]}, r
        # every collective of the step ran the native op; none did with the Python gather, which gloo ran instead
        assert native["ran"]["native"] == native["allgather_collectives"], native
        assert python["ran"]["native"] == 0 and python["ran"]["c10d"] >= python["allgather_collectives"], python
        assert native["losses"] == python["losses"], "native and Python gathers gave different losses"
        assert native["gathers"] == python["gathers"]
        assert native["allgather_bytes_by_dtype"] == python["allgather_bytes_by_dtype"]
        assert native["allgather_bytes_by_dtype"]["torch.bfloat16"] > 0  # the fused cast ran in both
        print(f"time in gather ops over a step, native / python: {native['gather_seconds']:.4f} s / "
              f"{python['gather_seconds']:.4f} s = {native['gather_seconds'] / python['gather_seconds']:.2f}")


def _collective_orders(backend):
    from deepspeed.compile.report import issued_collectives, record_gathered_timeline
    from models import ds_config
    from training import make_engine, train
    # gathers coalesced into runs (a 3000-element prefetch bucket), the next run started ahead
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True, "prefetch": 2},
                                          zero_overrides={"stage3_prefetch_bucket_size": 3000}))
    engine.compile(backend=backend)
    record_gathered_timeline(engine)
    train(engine, "gpt", 3)
    return {"static": collective_orders(engine), "issued": issued_collectives(engine),
            "ahead": runtime_of(engine).counters.gather.runs_started_ahead}


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_collective_order_is_the_same_on_every_rank(backend):
    """The compiled graphs' static order, and the collectives the runtime actually issued (coalesced runs started
    ahead of their use, bucket flushes), are the same on both ranks: kind, parameters and size, in order."""
    r0, r1 = run_distributed(_collective_orders, backend, timeout_s=300)
    assert len(r0["static"]) == 2 and all(order for order in r0["static"])  # one forward and one backward graph
    assert r0["static"] == r1["static"]
    issued = r0["issued"]
    assert {kind for kind, _, _ in issued} == {"all-gather", "reduce-scatter"}, issued[:4]
    assert any(len(ds_ids) > 1 for kind, ds_ids, _ in issued if kind == "all-gather"), issued[:8]  # coalesced
    assert r0["ahead"] > 0 and r1["ahead"] > 0, (r0["ahead"], r1["ahead"])
    assert issued == r1["issued"]


def test_persistent_parameters_match_eager_zero3():
    from compare import assert_bitwise_equal
    # norms, biases and the position table persist (not partitioned): they are not among the graphs' gathers
    for r in run_distributed(_pair, "gpt", "fp32", {}, STEPS, 1, "adamw", {"persistence_threshold": 1000}):
        _check_common(r)
        assert_bitwise_equal(r)
        assert r["persistent"] > 0, r["persistent"]
        gathered = r["gathered_params"]
        assert gathered and not any("norm" in name or name.endswith("bias") for name in gathered), sorted(gathered)


def _gather_timeout(native_op, flag, prefetch_bucket=0):
    import datetime
    import os
    import time
    import torch.distributed as dist
    from models import ds_config, make_batch
    from training import make_engine, train
    from deepspeed.compile.native.gather import OP_NAME
    from deepspeed.compile.report import engine_report
    # on the process group, the path under test (shared memory's own wait is test_host_comm.py's)
    engine = make_engine("gpt", ds_config(3, {"deepcompile": True, "native_op": native_op, "host_comm": "gloo",
                                              "collective_timeout_s": 2},
                                          zero_overrides={"stage3_prefetch_bucket_size": prefetch_bucket}))
    engine.compile(backend="eager")
    # the first step compiles each graph where it first runs: one rank may reach a gather seconds before the other,
    # longer than the bound under a loaded machine, so it runs with a wider one; the hang below meets the configured 2 s
    comm = runtime_of(engine).comm
    configured, comm.timeout = comm.timeout, datetime.timedelta(seconds=60)
    train(engine, "gpt", 1)  # compiled on both ranks
    paths = engine_report(engine)["gather_collectives_by_path"]
    comm.timeout = configured
    assert configured == datetime.timedelta(seconds=2), configured
    dist.barrier()
    # the agreement before the graph's first collective (runtime/agreement.py) would time out first: not the wait
    # under test here
    runtime_of(engine).peers.agree = lambda code, cause="": None
    if dist.get_rank() == 1:
        # never joins the next gather, and stays alive until rank 0 is done (so it sees a timeout, not a hang-up)
        deadline = time.monotonic() + 20
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    start = time.perf_counter()
    try:
        raised, ran = _ops_ran(lambda: engine(*make_batch("gpt", 1, 0)))
    finally:
        open(flag, "w").close()
    seconds = time.perf_counter() - start
    if not isinstance(raised, TimeoutError):
        raise AssertionError(f"expected a TimeoutError, got {raised!r}")
    return str(raised), seconds, paths, {"native": ran[OP_NAME], "c10d": ran["c10d::_allgather_base_"]}


@pytest.mark.parametrize("native_op, prefetch_bucket", [("python", 0), ("native", 0), ("python", 20000)])
def test_collective_timeout_names_the_gather(native_op, prefetch_bucket, tmp_path):
    """compile.collective_timeout_s: a rank that never joins a gather inside a compiled graph makes the other raise
    TimeoutError naming the gather's parameter(s), within the bound (2 s, plus slack for the step), on both paths
    of a lone gather, and for a run of gathers coalesced into one collective (a 20000-element prefetch bucket), which
    the runtime waits for apart from the gather op (``CommLog.wait``: without the bound there, rank 0 waited until
    rank 1 gave up 20 s later and gloo raised "Connection closed by peer")."""
    message, seconds, paths, ran = run_distributed(_gather_timeout, native_op, str(tmp_path / "done"), prefetch_bucket,
                                                   collective_timeout_s=60)[0]
    # the first step's gathers took the path under test (a run goes through Python on CPU: the native op takes one
    # shard), and so did the one that timed out: the profiler saw its op start
    path = "python" if prefetch_bucket else native_op
    assert set(paths) == {path}, paths
    assert (ran["native"] > 0) == (path == "native") and ran["c10d"] > 0, ran
    assert "collective_timeout_s" in message, message
    # a run names its parameters, a lone gather its one
    assert ("all-gather of parameters 'tok.weight'" if prefetch_bucket else "all-gather of parameter 'tok.weight'") \
        in message, message
    assert seconds < 15, seconds
