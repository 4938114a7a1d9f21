# SPDX-License-Identifier: Apache-2.0
"""The drop-in module: import precedence, the engine contract, config validation, fallbacks, the harness."""
import contextlib
import math
import os
import subprocess
import sys
import time
from importlib import metadata

import pytest

import checkout
from distributed import RankFailure, RankTimeout, run_distributed
from machine import unavailable_here


def _active_module_file(env_value):
    env = {k: v for k, v in os.environ.items() if k != "DEEPSPEED_COMPILE_MODULE"}
    if env_value is not None:
        env["DEEPSPEED_COMPILE_MODULE"] = env_value
    out = subprocess.run([sys.executable, "-c", "import deepspeed.compile as m; print(m.__file__)"],
                         env=env, cwd="/", capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_checkout_module_is_under_test():
    import deepspeed.compile
    assert os.path.dirname(deepspeed.compile.__file__) == checkout.PACKAGE_DIR
    assert deepspeed.compile.IMPLEMENTATION == "deepspeed-compile"


def test_stock_module_selected_by_env():
    path = _active_module_file("stock")
    assert path.endswith(os.path.join("deepspeed", "compile", "__init__.py"))
    assert "deepspeed_compile" not in path and not path.startswith(checkout.REPO_ROOT + os.sep + "deepspeed")


def test_installed_package_takes_precedence():
    try:
        metadata.distribution("deepspeed-compile")
    except metadata.PackageNotFoundError:
        unavailable_here("installed")
    path = _active_module_file(None)
    assert path.endswith(os.path.join("deepspeed_compile", "__init__.py")), path
    # DeepSpeed's own files are untouched: the stock module is still there beside ours.
    assert os.path.isfile(os.path.join(os.path.dirname(_active_module_file("stock")), "init_z3.py"))


def test_uninstalling_leaves_the_stock_module():
    """``pip uninstall`` removes exactly the files the installed distribution's RECORD lists: all are our package, its
    metadata, the import hook and the one ``.pth`` that loads it; none is under DeepSpeed's own ``deepspeed/``. With
    them gone nothing answers for ``deepspeed.compile`` but DeepSpeed's own module (``stock`` above imports it)."""
    try:
        dist = metadata.distribution("deepspeed-compile")
    except metadata.PackageNotFoundError:
        unavailable_here("installed")
    files = [str(f) for f in dist.files]
    dist_info = f"deepspeed_compile-{dist.version}.dist-info/"
    outside = sorted(f for f in files if not f.startswith(("deepspeed_compile/", dist_info)))
    pth = [f for f in outside if f.endswith(".pth")]
    assert pth == ["deepspeed_compile-precedence.pth"], outside
    assert set(outside) - set(pth) <= {"_deepspeed_compile_hook.py",
                                       f"__pycache__/_deepspeed_compile_hook.{sys.implementation.cache_tag}.pyc"}, outside
    assert not any(f.startswith("deepspeed/") for f in files), outside
    hook = dist.locate_file(pth[0]).read_text().strip().splitlines()
    assert len(hook) == 1 and hook[0].startswith("import _deepspeed_compile_hook"), hook


def test_unknown_compile_key_names_the_key():
    from deepspeed.compile.config import CompileConfig
    with pytest.raises(ValueError, match="partitionr"):
        CompileConfig(deepcompile=True, partitionr="min_cut")
    with pytest.raises(ValueError, match="partitioner"):
        CompileConfig(deepcompile=True, partitioner="greedy")


def test_bad_schedule_and_backend_are_refused():
    from deepspeed.compile.config import CompileConfig
    from deepspeed.compile.engine_state import check_compile_request
    with pytest.raises(ValueError, match="schedule"):
        check_compile_request(CompileConfig(deepcompile=True), "eager", [(0, ["prefetch"])])
    with pytest.raises(ValueError, match="aot_eager"):
        check_compile_request(CompileConfig(deepcompile=True), "aot_eager", None)


def test_parameter_offload_runs_where_the_shards_are_in_memory():
    """The engine sets stock's ``offload_parameters`` when ZeRO-3 offloads parameters and optimizer to the CPU:
    ZeRO-3's pipeline runs then (the shards stay on the CPU, test_parity_options.py). Shards on NVMe, or the option
    without ZeRO's offload_param, fall back with a warning naming what to set."""
    from deepspeed.compile.config import CompileConfig
    from deepspeed.compile.engine_state import _check_options
    from training import RecordWarnings
    config = CompileConfig(deepcompile=True, offload_parameters=True)
    warnings = RecordWarnings()
    assert _check_options(config, "eager", None, param_offload="cpu") and not warnings.messages
    assert not _check_options(CompileConfig(deepcompile=True), "eager", None, param_offload="nvme")
    assert not _check_options(config, "eager", None, param_offload="none")  # ZeRO-1/2, or no ZeRO offload
    nvme, alone = warnings.messages
    assert "offload_param.device='nvme'" in nvme and "falling back" in nvme, nvme
    assert "offload_parameters" in alone and "offload_param.device='cpu'" in alone, alone


def test_zeropp_options_deepcompile_does_not_apply_are_named():
    """ZeRO++'s quantized gathers and reduces (not runnable on CPU, even in eager ZeRO-3) and hpZ are named in the
    warning ``engine.compile()`` logs (``_zero12_activation`` checks it is logged, with hpZ)."""
    from types import SimpleNamespace
    from deepspeed.compile.engine_state import unapplied_zeropp_options
    zero = SimpleNamespace(zero_quantized_weights=True, zero_quantized_nontrainable_weights=False,
                           zero_quantized_gradients=True, zero_hpz_partition_size=1)
    assert unapplied_zeropp_options(zero) == ["zero_quantized_weights", "zero_quantized_gradients"]
    zero = SimpleNamespace(zero_quantized_weights=False, zero_quantized_nontrainable_weights=True,
                           zero_quantized_gradients=False, zero_hpz_partition_size=8)
    assert unapplied_zeropp_options(zero) == ["zero_quantized_nontrainable_weights", "zero_hpz_partition_size"]
    zero.zero_quantized_nontrainable_weights, zero.zero_hpz_partition_size = False, 1
    assert unapplied_zeropp_options(zero) == []


def test_activation_checkpointing_settings_a_compiled_checkpoint_does_not_follow_are_named():
    """DeepSpeed's checkpoint functions are compiled as torch's (``integrations/ds_checkpointing.py``): host offload and
    partitioning of the checkpointed inputs are named in the warning ``engine.compile()`` logs; recomputation-only
    settings are not."""
    from types import SimpleNamespace
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
    from deepspeed.compile.integrations.ds_checkpointing import unsupported_settings

    def named(section):
        config = DeepSpeedActivationCheckpointingConfig({"activation_checkpointing": section})
        return unsupported_settings(SimpleNamespace(activation_checkpointing_config=config))

    assert named({}) == []
    assert named({"synchronize_checkpoint_boundary": True, "number_checkpoints": 4}) == []
    assert named({"cpu_checkpointing": True}) == ["cpu_checkpointing"]
    assert named({"partition_activations": True, "cpu_checkpointing": True}) == ["cpu_checkpointing",
                                                                                 "partition_activations"]


def test_deepspeed_checkpoint_is_traced_only_inside_a_deepcompile_forward():
    """The substitute for ``deepspeed.checkpointing.checkpoint`` traces torch's checkpoint only while a DeepCompile
    forward runs; anywhere else (plain ``torch.compile``) dynamo breaks the graph there and DeepSpeed's own function
    runs eagerly, as without DeepCompile. Both give the eager result."""
    import deepspeed
    import torch._dynamo.testing
    from torch._dynamo.utils import counters
    from deepspeed.compile.integrations import ds_checkpointing
    ds_checkpointing.install()
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)

    def f(x):
        return deepspeed.checkpointing.checkpoint(lambda t: torch.relu(linear(t)), x).sum()

    x = torch.randn(2, 4, requires_grad=True)
    seen = {}
    for inside in (False, True):
        torch._dynamo.reset()
        counters.clear()
        graphs = torch._dynamo.testing.CompileCounter()
        with ds_checkpointing.deepcompile_forward() if inside else contextlib.nullcontext():
            out = torch.compile(f, backend=graphs)(x)
        seen[inside] = (out.item(), graphs.op_count, sum(counters["graph_break"].values()))
    expected = f(x).item()
    assert seen[False][0] == expected and seen[False][1] == 1 and seen[False][2] >= 1, seen  # only the sum compiled
    assert seen[True][0] == expected and seen[True][1] > 1 and seen[True][2] == 0, seen  # the checkpoint in the graph


def test_regions_blocks_is_refused_where_it_cannot_serve():
    from deepspeed.compile.driver import regions
    from models import make_model
    assert len(regions.repeated_blocks(make_model("gpt"))) == 2  # the test GPT's two blocks
    with pytest.raises(ValueError, match="regions='blocks': the model has no repeated blocks"):
        regions.check(make_model("mlp"))
    regions.check(make_model("gpt"))  # accepted at every ZeRO stage (test_zero12.py trains ZeRO-1/2 block by block)


def test_regions_blocks_warns_of_a_transformers_kv_cache():
    """A transformers model that keeps its config's use_cache=True compiles its block once per layer (each layer
    updates its own cache entry, and dynamo guards on it): blocks mode says so, and how to avoid it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from deepspeed.compile.integrations import transformers as integration
    from models import make_model

    def llama(use_cache):
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, use_cache=use_cache))

    assert "use_cache = False" in integration.kv_cache_warning(llama(True))
    assert integration.kv_cache_warning(llama(False)) is None
    assert integration.kv_cache_warning(make_model("gpt")) is None


# ----- 2 ranks ---------------------------------------------------------------------------------------------

def _train_zero3_deepcompile():
    import time
    import torch
    from deepspeed.compile.passes import prefetch
    from deepspeed.compile.report import collective_spans, engine_report, record_gathered_timeline
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from models import ds_config
    from training import make_engine, train
    engine = make_engine("mlp", ds_config(3, {"deepcompile": True}))
    wrapped = torch.nn.functional.linear is zero3_linear_wrap  # ZeRO-3 installs its wrapper for the process
    # a torch.compile mode as Accelerate passes Trainer's torch_compile_mode: inductor's, so nothing with eager
    losses = train(engine, "mlp", 7, compile_kwargs={"backend": "eager", "compile_kwargs": {"mode": "max-autotune"}})
    record_gathered_timeline(engine)
    before, start = engine_report(engine), time.perf_counter()
    losses += train(engine, "mlp", 1, first_step=7)
    end, after = time.perf_counter(), engine_report(engine)
    out = {"wrapped_before": wrapped, "wrapped_after": torch.nn.functional.linear is zero3_linear_wrap,
           "pass_times": dict(engine.get_compile_time()), "spans": collective_spans(engine), "window": (start, end),
           # the collectives the runtime counted in the recorded step, by the kind a span names
           "counted": {"all-gather": after["allgather_collectives"] - before["allgather_collectives"],
                       "reduce-scatter": after["reduce_collectives"] - before["reduce_collectives"]}}
    engine.register_compile_pass(prefetch.NAME, prefetch.schedule_prefetch, prefetch.CONTRACT)  # stock: accepted
    try:
        engine.register_compile_pass("my_pass", lambda gm: gm)
    except ValueError as err:
        out["custom_pass_error"] = str(err)
    return losses, engine.is_deepcompile_active(), engine_report(engine), out


def test_zero3_deepcompile_initializes_and_trains():
    from compare import loss_fell
    for losses, active, report, out in run_distributed(_train_zero3_deepcompile):
        assert active, "the engine does not run DeepCompile"
        # ZeRO-3's F.linear wrapper stays installed for the whole process (dynamo traces it as linear inside our
        # graphs: one graph, no break), and the engine's compile-time view shows this engine's passes
        assert out["wrapped_before"] and out["wrapped_after"], out
        assert {"insert_releases", "fast_free_schedule", "insert_reduces"} <= set(out["pass_times"]), out
        assert "my_pass" in out.get("custom_pass_error", ""), out
        # one recorded step: a span for every collective the runtime counted in it, each issued before its wait
        # ended, both within the step
        spans, (start, end) = out["spans"], out["window"]
        assert {kind: sum(k == kind for k, _, _ in spans) for kind in out["counted"]} == out["counted"], (spans, out)
        assert all(n > 0 for n in out["counted"].values()), out["counted"]
        assert all(start <= a <= b <= end for _, a, b in spans), (start, end, spans)
        # the graphs this module compiled did the work: gathers in forward and backward, reduces in backward
        assert report is not None and report["graphs_compiled"] == 1, report  # one forward graph
        assert report["gathers"] > 0 and report["reduces"] > 0 and report["live_gathered_bytes"] == 0, report
        assert len(losses) == 8 and all(math.isfinite(x) for x in losses), losses
        assert loss_fell(losses, by=0.1), losses  # learnable data (models.py): measured 30 % or more


def _initialize_with_bad_key():
    from models import ds_config
    from training import make_engine
    try:
        make_engine("mlp", ds_config(3, {"deepcompile": True, "bucket": 3}))
    except ValueError as e:
        return str(e)
    return None


def test_bad_compile_key_fails_at_initialize():
    messages = run_distributed(_initialize_with_bad_key)
    assert all(m is not None and "bucket" in m for m in messages), messages


def _zero12_activation():
    """ZeRO-1 with stock's ``"passes": ["z1"]`` and ZeRO-2 run this module's pipeline; a stock option it does not
    implement (offload) still falls back to plain torch.compile with one warning naming it; the AutoSP pass without a
    ``sequence_parallel_size`` runs the pipeline and says there is nothing to split; ZeRO-3 with hpZ runs and warns
    that hpZ is not applied."""
    from models import ds_config
    from training import RecordWarnings, make_engine, train
    from deepspeed.compile.report import engine_report
    out = {}
    for name, stage, section in (("z1", 1, {"deepcompile": True, "passes": ["z1"]}), ("z2", 2, {"deepcompile": True}),
                                 ("offload", 2, {"deepcompile": True, "offload_activation": True}),
                                 ("autosp", 1, {"deepcompile": True, "passes": ["autosp"]}),
                                 ("hpz", 3, {"deepcompile": True})):
        warnings = RecordWarnings()
        overrides = {"zero_hpz_partition_size": 2} if name == "hpz" else None
        engine = make_engine("mlp", ds_config(stage, section, zero_overrides=overrides))
        losses = train(engine, "mlp", 3, compile_kwargs={"backend": "eager"})
        report = engine_report(engine)
        out[name] = {"losses": losses, "warnings": [m for m in warnings.messages if "deepspeed-compile" in m],
                     "active": engine.is_deepcompile_active(), "stage": report and report["zero_stage"],
                     "reduces": report and report["reduces"],
                     # plain torch.compile: the module's call goes through torch's compiled wrapper
                     "torch_compiled": engine.is_compiled and engine.module._compiled_call_impl is not None}
        engine.destroy()
    return out


def test_zero1_and_zero2_run_deepcompile_and_unimplemented_options_fall_back():
    for out in run_distributed(_zero12_activation):
        for name, stage in (("z1", 1), ("z2", 2)):
            r = out[name]
            assert r["active"] and r["stage"] == stage and r["reduces"] > 0 and not r["warnings"], r
            assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), r
        r = out["offload"]
        assert not r["active"] and len(r["warnings"]) == 1 and "offload_activation" in r["warnings"][0], r
        assert "falling back to plain torch.compile" in r["warnings"][0] and r["torch_compiled"], r
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), r
        r = out["autosp"]
        assert r["active"] and r["stage"] == 1 and len(r["warnings"]) == 1, r
        assert "'autosp'" in r["warnings"][0] and "sequence_parallel_size is 1" in r["warnings"][0], r
        r = out["hpz"]  # runs (bitwise eager ZeRO-3 in a scratch run), saying hpZ's secondary partition is not used
        assert r["active"] and r["reduces"] > 0 and len(r["warnings"]) == 1, r
        assert "zero_hpz_partition_size" in r["warnings"][0], r


def test_autosp_and_autotp_adapters_warn_once_and_fall_back(caplog):
    """Stock's engine asks ``init_tp.init_autotp`` for a backend when the config names the pass (only with
    tensor_parallel.autotp_size > 1, which this 2-rank harness does not build), and ``init_sp.init_autosp`` at ZeRO-0
    (``test_sequence.py``); called other than from an ``engine.compile()``, each logs one warning naming its pass and
    returns None, on which the engine compiles with plain torch.compile."""
    import logging
    import torch
    from deepspeed.compile.init_sp import init_autosp
    from deepspeed.compile.init_tp import init_autotp
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        for name, adapter, arg in (("autosp", init_autosp, None), ("autotp", init_autotp, torch.nn.Linear(2, 2))):
            caplog.clear()
            assert adapter(arg) is None
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and f"'{name}'" in warnings[0], warnings
            assert "falling back to plain torch.compile" in warnings[0], warnings
    finally:
        logger.removeHandler(caplog.handler)


def _hang_in_collective():
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(3600)


def test_harness_reports_hung_collective():
    """The collective itself never times out (600 s): only the harness's own deadline can end this. Each killed
    rank's Python stack is in the message: where it hung."""
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"rank\(s\) \[0, 1\] did not finish within 6 s") as info:
        run_distributed(_hang_in_collective, timeout_s=6, collective_timeout_s=600)
    assert time.monotonic() - start < 30
    message = str(info.value)
    stacks = message.split("--- rank 1: last")
    assert len(stacks) == 2 and "--- rank 0: last" in stacks[0], message
    assert "in _hang_in_collective" in stacks[0] and "all_reduce" in stacks[0], message
    assert "in _hang_in_collective" in stacks[1] and "all_reduce" not in stacks[1], message


def _abort_on_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        print("rank 1 about to abort", flush=True)
        os.abort()  # as gloo's C++ does on an exception in its own threads (SIGABRT, exit code -6)
    return "ok"


def test_harness_reports_a_crashed_ranks_last_words():
    """A rank killed by a signal leaves no traceback of its own: its log's last lines (what it printed, then
    faulthandler's dump of its threads' stacks) are in the message. CI once showed only 'rank 1 (exit code -6)'."""
    with pytest.raises(RankFailure) as info:
        run_distributed(_abort_on_rank_1, timeout_s=60)
    message = str(info.value)
    assert "rank 1 (exit code -6) exited without a result (crashed)" in message, message
    tail = message.split("--- rank 1: last")[1]
    assert "rank 1 about to abort" in tail and "Fatal Python error: Aborted" in tail, message
    assert "in _abort_on_rank_1" in tail, message
    assert "--- rank 0: last" not in message  # rank 0 returned


def test_harness_reports_collective_timeout_as_failure():
    # gloo gives up on rank 0's all_reduce after 2 s: that is rank 0's failure, with its traceback; rank 1
    # (asleep) is killed the grace period (2 s here) later, long before the harness's own 120 s deadline
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_distributed(_hang_in_collective, timeout_s=120, collective_timeout_s=2, failure_grace_s=2)
    message = str(info.value)
    assert "--- rank 0 ---" in message and "all_reduce" in message, message
    assert "--- rank 1 ---" not in message
    assert "rank(s) [1] were still running 2 s after" in message, message
    assert time.monotonic() - start < 60


def _record_pid_and_sleep(pid_dir):
    with open(os.path.join(pid_dir, str(os.getpid())), "w"):
        pass
    time.sleep(3600)


def test_harness_kills_ranks_when_interrupted(tmp_path):
    """pytest-timeout ends a test by raising in the main thread (its signal method): the ranks must die too."""
    import signal
    import threading

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    def interrupt_when_both_ranks_run():
        while len(os.listdir(tmp_path)) < 2:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=interrupt_when_both_ranks_run, daemon=True).start()
        with pytest.raises(Interrupted):
            run_distributed(_record_pid_and_sleep, str(tmp_path), timeout_s=120)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    pids = [int(name) for name in os.listdir(tmp_path)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped


def test_harness_timeouts_fit_under_pytest_timeout():
    import distributed
    assert distributed.MAX_TIMEOUT_S < distributed.PYTEST_TIMEOUT_S
    with pytest.raises(ValueError, match="timeout_s"):
        run_distributed(_hang_in_collective, timeout_s=distributed.PYTEST_TIMEOUT_S)


def _what_the_fork_server_gave():
    import gc
    import sys
    import distributed
    return {"missing": [m for m in distributed.PRELOAD if m not in sys.modules], "frozen": gc.get_freeze_count()}


def test_ranks_start_with_the_fork_servers_preloaded_modules_and_frozen_heap():
    """Every module of the preload list, the test helpers included, is already imported when a rank starts, and the
    server's heap is frozen (``forkserver_ready``): a helper the server cannot import is skipped without a word, and
    each rank then pays for it again (Python 3.11's server ignores the caller's path: distributed.py hands it this
    directory through ``PYTHONPATH``)."""
    for r in run_distributed(_what_the_fork_server_gave):
        assert r["missing"] == [] and r["frozen"] > 100_000, r
