# SPDX-License-Identifier: Apache-2.0
"""The native fused cast + all-gather (``dsc_native::cast_all_gather``) against its pure-Python twin.

The op is JIT-built once per test session by the ``native_library`` fixture (into ``TORCH_EXTENSIONS_DIR``,
see ``checkout.py``); the spawned ranks then load the cached library. Multi-rank checks run on 2 gloo ranks
(``run_distributed``); rank functions import deepspeed-dependent modules inside, after ``checkout``.
"""
import logging
import time
from typing import Dict, List, Optional, Tuple

import os

import pytest
import torch

from distributed import run_distributed
from machine import unavailable_here

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# parameter sizes: divisible by 2 ranks, not divisible (37: padded to 2 x 19), and a larger one
PARAM_NUMELS = (36, 37, 4099)
# how late rank 1 starts the collectives whose start must not block: rank 0's two starts must return within half of
# it (a start that blocked would wait all of it for rank 1), a bound a loaded machine's scheduling cannot reach
LATE_S = 3.0


def require_buildable(reasons: List[str], under_ci: bool) -> None:
    """The build rule: under CI (``.ci/run`` sets ``CI=true`` unless the caller set it) an op that cannot be built
    fails the tests that need it (never a silent fallback in CI); elsewhere they skip, saying why
    (``machine.unavailable_here``)."""
    if reasons:
        unavailable_here("native_op", "; ".join(reasons), ci=under_ci)


def test_unbuildable_op_fails_under_ci_and_skips_elsewhere():
    with pytest.raises(pytest.fail.Exception, match="CI must run this test, but the native op cannot be built here: "
                                                    "no compiler"):
        require_buildable(["no compiler"], under_ci=True)
    with pytest.raises(pytest.skip.Exception, match="cannot be built here: no compiler"):
        require_buildable(["no compiler"], under_ci=False)
    require_buildable([], under_ci=True)  # buildable: nothing raised


def test_ci_script_sets_ci_unless_the_caller_did():
    import subprocess
    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", ".ci", "run")
    line = next(l.strip() for l in open(script) if l.strip().startswith("export CI="))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    assert subprocess.run(["bash", "-c", line + '; echo "$CI"'], env=env, capture_output=True,
                          text=True).stdout.strip() == "true"
    env["CI"] = "false"
    assert subprocess.run(["bash", "-c", line + '; echo "$CI"'], env=env, capture_output=True,
                          text=True).stdout.strip() == "false"


@pytest.fixture(scope="session")
def native_library() -> str:
    """Build (or find in the cache) the native library once per session; skip only if it cannot be built."""
    from deepspeed.compile.native.builder import NativeOpBuilder
    from deepspeed.compile.native.gather import native_op_error
    require_buildable(NativeOpBuilder().incompatibility_reasons(), os.environ.get("CI") == "true")
    error = native_op_error()
    assert error is None, f"native op is buildable here but failed to build or load: {error}"
    return NativeOpBuilder().load()


def _zero3_shard(param: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of ``param`` as ZeRO-3 keeps it: flat, padded to a multiple of ``world_size``."""
    shard_numel = -(-param.numel() // world_size)
    padded = torch.zeros(shard_numel * world_size, dtype=param.dtype)
    padded[:param.numel()] = param.reshape(-1)
    return padded.narrow(0, rank * shard_numel, shard_numel).clone()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ----- rank functions (module level: each rank imports them by name) ---------------------------------------
def _rank_native_matches_python(dtype_names: List[str], numels: Tuple[int, ...]) -> Dict[str, Tuple[int, int]]:
    import torch.distributed as dist
    from deepspeed.compile.native import cast_all_gather_python, cast_all_gather_start, load_native

    native = load_native("native")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    subgroup = dist.new_group(list(range(world_size)))  # a non-default group resolves by its own name
    checked = {}
    timed = False
    for numel in numels:
        torch.manual_seed(numel)  # same full parameter on every rank
        param = torch.randn(numel, dtype=torch.float32) * 3.0
        shard = _zero3_shard(param, rank, world_size)
        for name in dtype_names:
            dtype = DTYPES[name]
            for group in (None, subgroup):
                out_native = native(shard, dtype, group, world_size)
                out_python = cast_all_gather_python(shard, dtype, group, world_size)
                assert out_native.dtype == out_python.dtype == dtype
                assert out_native.shape == out_python.shape == (shard.numel() * world_size, )
                assert torch.equal(_bits(out_native), _bits(out_python)), (numel, name)
                # and both are the cast of the full parameter (padding trimmed), shard by shard
                assert torch.equal(_bits(out_native[:numel]), _bits(param.to(dtype))), (numel, name)
                assert not torch.any(out_native[numel:]), "padding must gather as zeros"
                # the start form: two collectives in flight at once, waited for in the other order. Once, rank 1
                # starts late: rank 0's starts must return before rank 1 joins, and its waits wait for it
                late = not timed and group is None
                if late and rank == 1:
                    time.sleep(LATE_S)
                began = time.perf_counter()
                first = cast_all_gather_start(shard, dtype, group, world_size)
                second = cast_all_gather_start(shard * 2, dtype, group, world_size)
                started = time.perf_counter()
                second.wait()
                first.wait()
                if late:
                    timed = True
                    if rank == 0:
                        assert started - began < LATE_S / 2 <= time.perf_counter() - began, (started - began,
                                                                                           time.perf_counter() - began)
                assert torch.equal(_bits(first.flat), _bits(out_python)), (numel, name)
                assert torch.equal(_bits(second.flat), _bits(cast_all_gather_python(shard * 2, dtype, group,
                                                                                      world_size))), (numel, name)
            # what was gathered, as a checksum of its bytes: every rank must hold the same
            checked[f"{numel}/{name}"] = (out_native.numel(), int(_bits(out_native).sum()))
    # dtype None keeps the shard's dtype; a timeout (in ms on the C++ side) is accepted
    import datetime
    out = native(shard, None, None, world_size, datetime.timedelta(seconds=30))
    assert out.dtype == shard.dtype and torch.equal(out, cast_all_gather_python(shard, None, None, world_size))
    return checked


def _rank_opcheck(dtype_names: List[Optional[str]]) -> Dict[str, Dict[str, str]]:
    import torch.distributed as dist
    from deepspeed.compile.native import load_native

    load_native("native")
    op = torch.ops.dsc_native.cast_all_gather.default
    group_name, world_size = dist.group.WORLD.group_name, dist.get_world_size()
    results = {}
    # the start form's fake implementation and schema (its output is waited for by torch's wait_tensor)
    start = torch.ops.dsc_native.cast_all_gather_start.default
    flat = start(torch.randn(19), torch.bfloat16, group_name, world_size)
    torch.ops._c10d_functional.wait_tensor(flat)
    assert flat.shape == (19 * world_size, ) and flat.dtype == torch.bfloat16
    for name in dtype_names:
        dtype = None if name is None else DTYPES[name]
        for requires_grad in (False, True):
            shard = torch.randn(19, requires_grad=requires_grad)
            results[f"{name}/grad={requires_grad}"] = torch.library.opcheck(op, (shard, dtype, group_name, world_size))
    # the output of a collective is data: it never requires grad
    assert not op(torch.randn(3, requires_grad=True), None, group_name, world_size).requires_grad
    return results


def _rank_wrong_world_size() -> str:
    import torch.distributed as dist
    from deepspeed.compile.native import load_native

    native = load_native("native")
    with pytest.raises(RuntimeError, match="has 2 ranks, but world_size=3"):
        native(torch.randn(4), None, None, 3)
    dist.barrier()
    return "ok"


def _rank_fallback_when_unbuildable() -> List[str]:
    import os
    os.environ["CXX"] = "/nonexistent/c++"  # is_compatible() reports "no C++ compiler"; nothing is built
    from deepspeed.compile.native import cast_all_gather_python, load_native

    records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("deepspeed.compile.native.gather")
    logger.addHandler(handler)
    try:
        assert load_native("auto") is None
        assert load_native("auto") is None  # a second call must not warn again
    finally:
        logger.removeHandler(handler)
    with pytest.raises(RuntimeError, match="compile.native_op='native'"):
        load_native("native")
    shard = torch.arange(4, dtype=torch.float32)
    out = cast_all_gather_python(shard, torch.bfloat16, None, 1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, shard.to(torch.bfloat16))
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def _rank_cuda_collective_forms() -> Dict[str, tuple]:
    """The ZeRO-3 runtime's collectives in the forms it takes on CUDA, run here on gloo: each run of gathers started
    through the native op's start form (``Transport.native_start``, on only for CUDA parameters) and each gradient
    bucket reduce-scattered (``Transport.reduce_scatter_by_all_reduce`` off, as on NCCL), then in the gloo forms (a run received
    as rows of one all-gather, a bucket all-reduced in place). GPT under autocast (runs cast to bf16 before they are
    sent), a 3000-element prefetch bucket (runs of several parameters, the next started ahead), eager backend, SGD;
    and eager ZeRO-3 on the same data (under autocast and, for the bound, fp32), as the reference for the CUDA forms."""
    import torch.distributed as dist
    import deepspeed.compile.runtime.z3_runs as z3_runs
    from deepspeed.compile.engine_state import runtime_of
    from deepspeed.compile.report import engine_report, issued_collectives, record_gathered_timeline
    from compare import compiled_record, run_eager, train_and_record
    from models import ds_config
    from training import make_engine
    overrides = {"stage3_prefetch_bucket_size": 3000}
    reference = run_eager("gpt", 3, dtype="autocast", optimizer="sgd", zero_overrides=overrides)
    reference["fp32_grads"] = run_eager("gpt", 1, optimizer="sgd", zero_overrides=overrides)["eager_grads"]
    calls = {"start": 0, "reduce_scatter": 0}
    start, reduce_scatter = z3_runs.cast_all_gather_start, dist.reduce_scatter_single

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    z3_runs.cast_all_gather_start = counted("start", start)
    dist.reduce_scatter_single = counted("reduce_scatter", reduce_scatter)
    out = {}
    try:
        for forms in ("cuda", "gloo"):
            engine = make_engine("gpt", ds_config(3, {"deepcompile": True, "native_op": "native", "host_comm": "gloo"},
                                                  "autocast", optimizer="sgd", zero_overrides=overrides))
            engine.compile(backend="eager")
            runtime = runtime_of(engine)
            runtime.transport.native_start = forms == "cuda"
            runtime.transport.reduce_scatter_by_all_reduce = forms == "gloo"
            record_gathered_timeline(engine)
            first_id = min(runtime.params)  # each engine numbers its parameters on from the last one's
            record = train_and_record(engine, "gpt", 3, grad_steps=1)
            losses, norms = record["losses"], record["grad_norms"]
            report = engine_report(engine)
            issued = [(kind, tuple(i - first_id for i in ds_ids), numel)
                      for kind, ds_ids, numel in issued_collectives(engine)]
            out[forms] = {"losses": losses, "norms": norms, "issued": issued,
                          "bytes": report["allgather_bytes_by_dtype"],
                          "ahead": report["runs_started_ahead"], "calls": dict(calls),
                          "compared": {**reference, **record, **compiled_record(engine)}}
            calls.update(start=0, reduce_scatter=0)
            engine.destroy()
    finally:
        z3_runs.cast_all_gather_start, dist.reduce_scatter_single = start, reduce_scatter
    return out


# ----- tests -------------------------------------------------------------------------------------------------
def test_builder_finds_sources_in_checkout() -> None:
    from deepspeed.compile.native.builder import NativeOpBuilder, find_source_dir

    builder = NativeOpBuilder()
    source_dir = find_source_dir()
    assert source_dir is not None and source_dir.name == "compile" and source_dir.parent.name == "csrc"
    names = [p.rsplit("/", 1)[-1] for p in builder.sources()]
    assert names[:2] == ["dsc_native.cpp", "cast_all_gather_cpu.cpp"]
    assert builder.include_paths() == [str(source_dir)]
    assert builder.absolute_name() == "deepspeed.compile.native.deepspeed_compile_native_op"
    # CUDA sources and flags only where CUDA exists: both configurations, whatever this machine has
    for with_cuda in (False, True):
        class Builder(NativeOpBuilder):
            def with_cuda(self) -> bool:
                return with_cuda

        configured = Builder()
        cuda_names = [p.rsplit("/", 1)[-1] for p in configured.sources()]
        assert ("cast_all_gather_cuda.cpp" in cuda_names) == with_cuda, (with_cuda, cuda_names)
        assert ("-DDSC_WITH_CUDA" in configured.cxx_args()) == with_cuda, (with_cuda, configured.cxx_args())


def test_load_native_modes_without_process_group(native_library: str) -> None:
    from deepspeed.compile.native import cast_all_gather, load_native

    assert load_native("python") is None
    assert load_native("native") is cast_all_gather
    assert load_native("auto") is cast_all_gather
    with pytest.raises(ValueError, match="compile.native_op"):
        load_native("fast")


def test_fake_implementation(native_library: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        shard = torch.empty(19, dtype=torch.float32)
        out = torch.ops.dsc_native.cast_all_gather(shard, torch.bfloat16, "unused", 2)
    assert out.shape == (38, ) and out.dtype == torch.bfloat16


def test_opcheck_two_ranks(native_library: str) -> None:
    for per_rank in run_distributed(_rank_opcheck, [None, "bf16", "fp16"]):
        for key, result in per_rank.items():
            assert all(v == "SUCCESS" for v in result.values()), (key, result)


def test_native_matches_python_bitwise(native_library: str) -> None:
    results = run_distributed(_rank_native_matches_python, list(DTYPES), PARAM_NUMELS)
    assert results[0] == results[1] and len(results[0]) == len(PARAM_NUMELS) * len(DTYPES)
    assert results[0]["37/bf16"][0] == 38  # 37 padded to 2 shards of 19


def test_wrong_world_size_is_an_error(native_library: str) -> None:
    assert run_distributed(_rank_wrong_world_size) == ["ok", "ok"]


def test_auto_falls_back_with_one_warning() -> None:
    warnings = run_distributed(_rank_fallback_when_unbuildable, world_size=1)[0]
    assert len(warnings) == 1, warnings
    assert "no C++ compiler" in warnings[0] and "compile.native_op" in warnings[0]


def test_cuda_collective_forms_train_as_the_gloo_forms(native_library: str) -> None:
    """The collective forms the ZeRO-3 runtime takes on CUDA, which no test machine here runs on a GPU, give bitwise
    the same losses and gradient norms as the gloo forms, issue the same collectives (kind, parameters, size, in
    order) and gather the same bytes per dtype: the native start form receives a run in the same rank-major rows as
    the gloo all-gather, and a rank's row of the summed bucket is its reduce-scatter output (the same sum of the
    same values). The spies show that each engine ran its own forms and only those. Both are checked against eager
    ZeRO-3 trained in the same ranks, within the stated bf16 bound (``compare.check_bf16_against_eager``): two forms
    that agree with each other could both be wrong."""
    from compare import assert_ran_compiled, check_bf16_against_eager
    for r in run_distributed(_rank_cuda_collective_forms, timeout_s=300):
        cuda, gloo = r["cuda"], r["gloo"]
        for forms in (cuda, gloo):
            assert_ran_compiled(forms["compared"])
            print(check_bf16_against_eager(forms["compared"], "autocast"))
        assert cuda["calls"]["start"] > 0 and cuda["calls"]["reduce_scatter"] > 0, cuda["calls"]
        assert gloo["calls"] == {"start": 0, "reduce_scatter": 0}, gloo["calls"]
        assert cuda["ahead"] > 0 and gloo["ahead"] > 0
        assert cuda["losses"] == gloo["losses"] and cuda["norms"] == gloo["norms"], (cuda, gloo)
        assert cuda["issued"] == gloo["issued"] and cuda["bytes"] == gloo["bytes"]

