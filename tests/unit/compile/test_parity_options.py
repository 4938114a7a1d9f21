# SPDX-License-Identifier: Apache-2.0
"""Each of this module's own "compile" options against eager ZeRO-3 on the same data (2 gloo ranks, eager backend).

fp32 options (none set, ``schedule: "traced"``, ``prefetch: 2``, ``partitioner: "default"``, ``regions: "blocks"``,
``host_comm: "gloo"``, ``eager_graph_code: "fx"``; and a reduce bucket narrower than most gradients, which the
runtime then reduces where they lie) change where gathers, releases and saved tensors go, which graphs there are, how
collectives move between the ranks or what code runs a graph, never the arithmetic: losses, gradients
after every backward of the first 2 steps, parameters and buffers must be bitwise equal to eager ZeRO-3's.
``fused_cast: false`` only matters under autocast(bf16), where the compiled graph and eager ZeRO-3 round
differently: the bounds of test_pipeline.py apply against eager ZeRO-3, and the unfused graph must be bitwise equal to the fused one (casting a shard before the
gather or the gathered parameter after it gives the same bf16 values).
"""
import pytest

from distributed import run_distributed

STEPS = 6
FP32_OPTIONS = {"none": {}, "traced": {"schedule": "traced"}, "prefetch2": {"prefetch": 2},
                "default_partitioner": {"partitioner": "default"}, "blocks": {"regions": "blocks"},
                "gloo": {"host_comm": "gloo"}, "fx_code": {"eager_graph_code": "fx"}, "wide_grads": {}}


def _options_against_eager():
    from compare import run_compiled, run_eager
    fp32 = run_eager("gpt", STEPS, grad_steps=2)
    # block by block, gathers coalesced (a prefetch bucket of 3000 elements, so each block graph has several runs; the
    # other options gather one parameter at a time): runs are started ahead across the block graphs too. With a reduce
    # bucket of 200 columns most gradients are wider than a bucket, and those nothing else reads are reduced where
    # they lie. Eager ZeRO-3's arithmetic depends on neither bucket.
    buckets = {"blocks": {"zero_overrides": {"stage3_prefetch_bucket_size": 3000}},
               "wide_grads": {"zero_overrides": {"reduce_bucket_size": 400}}}
    out = {name: {**fp32, **run_compiled("gpt", STEPS, compile_section=section, grad_steps=2,
                                         **buckets.get(name, {}))}
           for name, section in FP32_OPTIONS.items()}
    # SGD under autocast: the first update is bounded like the gradient (see test_pipeline.py); the step-0
    # gradients of the fp32 run above are the fp32 reference (same start, same data, before any update)
    autocast = run_eager("gpt", STEPS, dtype="autocast", grad_steps=2, optimizer="sgd")
    for name, fused in (("unfused", False), ("fused", True)):
        out[name] = {**autocast, **run_compiled("gpt", STEPS, dtype="autocast", compile_section={"fused_cast": fused},
                                                grad_steps=2, optimizer="sgd")}
        out[name]["fp32_grads"] = fp32["eager_grads"]
    out.update(_offload_against_eager())
    return out


# ZeRO-3 keeping the parameter shards and the optimizer on the CPU (ZeRO-Offload, as in Hugging Face's "zero3 offload"
# config); the engine then sets stock's compile.offload_parameters. Coalesced gathers (a 3000-element prefetch bucket)
# as well as single ones.
OFFLOAD = {"zero_overrides": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                              "stage3_prefetch_bucket_size": 3000}}


def _offload_against_eager():
    """Eager ZeRO-3 and DeepCompile with the same offload config. Here the CPU is also the device the graphs compute
    on, so the shards need no copy; the run "offload_copied" takes the runtime's copy-to-device path anyway (a no-op
    copy on the CPU), so its concatenation and casts are checked too."""
    from compare import run_compiled, run_eager
    from deepspeed.compile.engine_state import runtime_of
    from training import RecordWarnings
    out = {}
    eager = run_eager("gpt", STEPS, grad_steps=2, **OFFLOAD)

    def take_copy_path(engine):
        runtime_of(engine).shards.offloaded = True

    for name, after_compile in (("offload", None), ("offload_copied", take_copy_path)):
        warnings = RecordWarnings()
        out[name] = {**eager, **run_compiled("gpt", STEPS, grad_steps=2, after_compile=after_compile, **OFFLOAD),
                     "warnings": [m for m in warnings.messages if "deepspeed-compile" in m]}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_options_against_eager, timeout_s=400)


@pytest.mark.parametrize("option", sorted(FP32_OPTIONS))
def test_fp32_option_matches_eager_zero3(results, option):
    from compare import (assert_bitwise_equal, assert_one_graph_serves_both_blocks, assert_ran_compiled,
                         assert_transport, loss_fell)
    for out in results:
        r = out[option]
        # block by block, the model's own frame runs as Python and reads two parameters eagerly (see below)
        assert_ran_compiled(r, eager_access=option == "blocks")
        assert r["live_after_step"] == [0] * STEPS
        # every gathered copy was used by an op: under "blocks" each run was planned on the first block and moved to
        # the block it ran on (gathering the first block's parameters there instead trains the same, at a cost)
        assert r["counters"]["unclaimed_gathers"] == 0, r["counters"]
        # gathers and reduces through shared memory ("auto": the ranks share this host), unless told otherwise
        assert_transport(r, "gloo" if option == "gloo" else "auto")
        assert_bitwise_equal(r)
        assert loss_fell(r["losses"], by=0.01), r["losses"]
    assert not any(out[option]["ran_uncompiled"] for out in results)
    if option == "blocks":  # one graph, compiled for the first block, ran compiled for the second one too
        for out in results:
            r = out[option]
            assert_one_graph_serves_both_blocks(r)
            # outside the blocks only what the model's own frame reads as Python is gathered on access, once a step:
            # the position table and the tied embedding weight of its output head. The embedding lookup and the final
            # norm run as compiled regions of their own (4 gathers a step before they did)
            assert r["counters"]["eager_gathers"] == 2 * STEPS, r["counters"]
            # from the second step on every run but the step's first was started ahead, across the block graphs
            # too (each graph's first run waits for its collective otherwise)
            runs = r["runs_per_step"]
            assert runs >= 12 and r["counters"]["runs_started_ahead"] >= (STEPS - 1) * (runs - 1), (runs, r["counters"])
    # the schedule options took effect: against the default schedule (just in time, one gather ahead), the traced
    # order gathers everything at the top and a second gather ahead holds more at once
    if option in ("traced", "prefetch2"):
        assert all(out[option]["planned_peak"] > out["none"]["planned_peak"] > 0 for out in results), [
            (out[option]["planned_peak"], out["none"]["planned_peak"]) for out in results]
    if option == "wide_grads":  # the tied embedding's gradient, summed in place, is one of them every backward
        assert all(out[option]["counters"]["grads_reduced_in_place"] >= STEPS for out in results)
    if option == "default_partitioner":  # the option took effect: parameters are saved for backward
        assert all(out[option]["saved"]["param_bytes"] > 0 for out in results)
    else:
        assert all(out[option]["saved"]["param_bytes"] == 0 for out in results)


def _graph_returning_a_parameter():
    from compare import run_pair
    return run_pair("gated", STEPS, compile_section={"regions": "blocks"}, grad_steps=2)


def test_a_block_returning_its_parameter_under_regions_blocks():
    """A block hands its gate parameter back to the model's frame, which multiplies by it as Python (dynamo cannot
    resume inside the loop over the blocks): that frame got the parameter holding its stand-in and computed with it
    (backward then stopped with StandinReadError). Each returned parameter is gathered for it now, as eager ZeRO-3
    gathers a returned parameter for the caller, and training is eager ZeRO-3's bit for bit."""
    from compare import assert_bitwise_equal, loss_fell
    for r in run_distributed(_graph_returning_a_parameter, timeout_s=240):
        assert r["active"] and r["live_after_step"] == [0] * STEPS and r["counters"]["gathers"] > 0
        assert r["counters"]["eager_gathers"] == 2 * STEPS, r["counters"]  # the two gates, once a step
        assert_bitwise_equal(r)
        assert loss_fell(r["losses"], by=0.01), r["losses"]


def _returned_parameter_past_a_graph_break():
    from compare import run_pair
    return run_pair("gated_break", STEPS, grad_steps=2)


def test_a_block_returning_its_parameter_past_a_graph_break():
    """The same at regions='model' with a graph break in the loop: dynamo runs the model's frame as Python and compiles
    each block's frame on its own, which returned the gate as the graph input it is, holding its stand-in (backward
    then stopped with StandinReadError; under no_grad the outputs were the stand-in's NaN). The block's forward,
    run as Python around its compiled frame, gathers the returned parameter for the caller
    (``eager_access.forward_gathering_returned``): eager ZeRO-3's training bit for bit."""
    from compare import assert_bitwise_equal, loss_fell
    for r in run_distributed(_returned_parameter_past_a_graph_break, timeout_s=240):
        assert r["active"] and r["live_after_step"] == [0] * STEPS and r["counters"]["gathers"] > 0
        # once a step: the two gates, and the head's weight and bias (``nn.Linear`` called from the Python frame
        # reads them eagerly: dynamo never starts a frame in torch.nn)
        assert r["counters"]["eager_gathers"] == 4 * STEPS, r["counters"]
        assert_bitwise_equal(r)
        assert loss_fell(r["losses"], by=0.01), r["losses"]


def test_unfused_cast_matches_eager_zero3_under_autocast(results):
    from compare import check_bf16_against_eager, unequal
    for out in results:
        r = out["unfused"]
        assert r["active"] and r["live_after_step"] == [0] * STEPS
        print("fused_cast false:", check_bf16_against_eager(r, "autocast"))
        # the option took effect: nothing was gathered in bf16; the fused run gathered the downcast weights in bf16
        assert r["counters"]["gathers"] > 0 and r["counters"]["allgather_bytes_by_dtype"]["torch.float32"] > 0
        assert "torch.bfloat16" not in r["counters"]["allgather_bytes_by_dtype"], r["counters"]
        assert out["fused"]["counters"]["allgather_bytes_by_dtype"]["torch.bfloat16"] > 0
        assert r["losses"] == out["fused"]["losses"]
        assert len(r["grads"]) == len(out["fused"]["grads"]) > 0
        for g, fg in zip(r["grads"], out["fused"]["grads"]):
            assert not unequal(g, fg)
        assert not unequal(r["params"], out["fused"]["params"])


@pytest.mark.parametrize("run", ["offload", "offload_copied"])
def test_parameter_and_optimizer_offload_to_cpu_runs_deepcompile_as_eager_zero3(results, run):
    from compare import assert_bitwise_equal
    for out in results:
        r = out[run]
        # DeepCompile ran (it used to fall back to plain torch.compile, which fails on this model), with no warning
        assert r["active"] and not r["warnings"] and r["live_after_step"] == [0] * STEPS, r["warnings"]
        assert r["counters"]["allgather_collectives"] < r["counters"]["gathers"], r["counters"]  # coalesced runs
        # the copy path ran where it was asked for, and nowhere else (the CPU is the device here)
        assert (r["counters"]["shard_copies"] > 0) == (run == "offload_copied"), r["counters"]
        assert_bitwise_equal(r)
