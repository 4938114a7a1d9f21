# SPDX-License-Identifier: Apache-2.0
"""The torch and DeepSpeed releases this package is written and tested against, and the check that the running ones
are among them, made when an engine turns DeepCompile on (``engine_state.activate_z3``/``activate_z12``).

The package replaces or wraps attributes of objects it does not own (:data:`TARGETS`: a ZeRO optimizer's bucket
reduction, a module's compiled call, dynamo's recompile-limit check) and calls others past their public API. Those
are stable within a release line and not across them, so another release is refused with one message naming both
versions and the supported ranges, before anything is changed, instead of failing deep inside a step. An attribute
gone from a supported release is refused the same way, naming it. ``DEEPSPEED_COMPILE_ALLOW_VERSIONS=1`` turns the
version refusal into a warning, to try another release at one's own risk; a missing attribute is always refused.

``requirements/requirements.txt`` declares the same ranges for pip, and ``requirements/constraints.txt`` the exact
releases the tests ran on.
"""
import importlib
import inspect
import logging
import os
import sys
from typing import Dict, List, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .adapters import ADAPTERS, ALL, Z12, Z3

log = logging.getLogger(__name__)

SUPPORTED: Dict[str, str] = {"torch": ">=2.13,<2.16", "deepspeed": ">=0.19.8,<0.20"}
ALLOW_ENV = "DEEPSPEED_COMPILE_ALLOW_VERSIONS"

# torch's private modules the package imports from, what it takes from each and the parameters it passes by name
# (``test_compat.py`` checks that every ``from torch._...`` import of the package is listed). Each is the same in the
# supported releases 2.13, 2.14 and 2.15: a later release that moves or changes one is refused here, naming it.
TORCH_INTERNALS = [
    ("torch._dynamo.convert_frame", None, {"exceeds_recompile_limit": None}, ALL),  # effects.py
    ("torch._dynamo.types", None, {"FrameAction": None, "FrameExecStrategy": None}, ALL),  # effects.py
    ("torch._dynamo.config", None, {"recompile_limit": None, "ignore_logging_functions": None,
                                    "skip_fwd_side_effects_in_bwd_under_checkpoint": None}, ALL),
    ("torch._dynamo.backends.common", None, {"aot_autograd": None}, ALL),  # driver/compiler.py
    ("torch._dynamo.exc", None, {"RestartAnalysis": None}, ALL),
    ("torch._dynamo.utils", None, {"counters": None}, ALL),  # runtime/eager_access.py
    # the keywords aot_autograd hands to it: the compilers and the partition function are the package's
    ("torch._functorch.aot_autograd", None, {"aot_module_simplified": (
        "fw_compiler", "bw_compiler", "partition_fn", "decompositions", "keep_inference_input_mutations")}, ALL),
    ("torch._functorch.partitioners", None, {
        "min_cut_rematerialization_partition": ("joint_module", "_joint_inputs", "num_fwd_outputs"),
        "default_partition": ("joint_module", "_joint_inputs", "num_fwd_outputs")}, ALL),
    ("torch._functorch.config", None, {"enable_autograd_cache": None}, ALL),
    ("torch._functorch._aot_autograd.schemas", None, {"SerializableAOTDispatchCompiler": ("output_code_ty",
                                                                                          "compiler_fn")}, ALL),
    ("torch._guards", None, {"detect_fake_mode": None}, ALL),
    ("torch._inductor.compile_fx", None, {"compile_fx_inner": ("gm", "example_inputs"), "partition_fn": None}, ALL),
    ("torch._inductor.config", None, {"custom_partitioner_fn": None}, ALL),
    ("torch._inductor.custom_graph_pass", None, {"CustomPartitionerFn": None, "get_hash_for_files": ("paths", "extra")},
     ALL),  # driver/cache.py
    ("torch._inductor.decomposition", None, {"select_decomp_table": None}, ALL),
    ("torch._inductor.output_code", None, {"OutputCode": None}, ALL),
    ("torch._inductor.runtime.cache_dir_utils", None, {"cache_dir": None}, ALL),
    ("torch._inductor.virtualized", None, {"V": None}, ALL),
]

# (module, class or None for the module itself, attributes, stages): what the package rebinds (its adapters'
# TARGETs, adapters.py) or calls by name on objects it does not own at those ZeRO stages, each attribute with the
# parameters it relies on (None: only that it exists). Attributes an object sets in its __init__ are checked on the
# object (:func:`require_attributes`).
TARGETS: List[Tuple[str, Optional[str], Dict[str, Optional[Tuple[str, ...]]], Tuple[int, ...]]] = [
    *(adapter.TARGET for adapter in ADAPTERS),
    *TORCH_INTERNALS,
    ("deepspeed.runtime.engine", "DeepSpeedEngine", {
        "is_deepcompile_active": None, "is_deepcompile_enabled": None, "_set_deepcompile_active": ("active", ),
        "_cast_inputs_half": ("inputs", ), "zero_prefetch_bucket_size": None, "zero_max_reuse_distance": None,
        "zero_max_live_parameters": None, "zero_reduce_bucket_size": None, "zero_offload_param": None}, ALL),
    # ZeRO-0 with sequence parallelism: the config reader whose stage decides where "autosp" goes (config.py), and
    # the engine's compile request, read from its frame by the AutoSP entry point (init_sp.py)
    ("deepspeed.runtime.config", "DeepSpeedConfig", {"_initialize_params": ("param_dict", )}, (0, )),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", {
        "get_deepspeed_compile_backend": ("backend", "compile_kwargs", "schedule"),
        "get_autosp_backend": ("compile_kwargs", )}, (0, )),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", {
        "process_gradients": ("param", "i"),
        "reenter_backward_if_needed": None, "update_hook_state_and_maybe_run_epilogue": None,
        "overlapping_partition_gradients_reduce_epilogue": None, "reduce_gradients": ("pipeline_parallel", ),
        "clear_grad_attribute": None, "copy_grads_in_partition": None, "get_param_comm_dtype": None,
        "set_gradient_accumulation_boundary": None, "is_gradient_accumulation_boundary": None}, Z12),
    # ZeRO-2's bucket reduction, left in flight (runtime/z12_reduce.py)
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", {
        "_use_compact_grad_partition_buffer": ("group_idx", )}, (2, )),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", {
        "independent_gradient_partition_epilogue": None, "partition_grads": None, "get_param_comm_dtype": None,
        "create_reduce_and_remove_grad_hooks": None}, Z3),
]


# what the ZeRO-1/2 runtime reads of the optimizer's state, set in its __init__ (runtime/z12.py, z12_reduce.py)
ZERO12_OPTIMIZER_STATE = (
    "_grad_acc_hooks", "bit16_groups", "dp_process_group", "reduce_bucket_size", "contiguous_gradients", "overlap_comm",
    "ipg_buckets", "zenflow", "use_grad_accum_attribute", "_coalesce_grad_reduction", "extra_large_param_to_reduce",
    "gradient_average", "sequence_parallel_size", "params_already_reduced", "param_to_partition_ids",
    "grad_start_offset", "param_dict", "is_param_in_current_partition", "ready_for_gradients", "partition_gradients",
    "reduce_scatter", "use_multi_rank_bucket_allreduce", "cpu_offload")


def version_problems(versions: Dict[str, str]) -> List[str]:
    """``name version`` of each package in ``versions`` outside its supported range (pre-releases and local builds
    of a supported release, ``2.13.0+cpu``, count as that release)."""
    return [f"{name} {found} (supported: {SUPPORTED[name]})" for name, found in versions.items()
            if not SpecifierSet(SUPPORTED[name], prereleases=True).contains(Version(Version(found).base_version))]


def target_problems(stage: int = 3, targets=None) -> List[str]:
    """Each target attribute of ZeRO stage ``stage`` that is missing, or that lacks a parameter the package passes
    to it."""
    problems = []
    for module_name, class_name, attributes, stages in TARGETS if targets is None else targets:
        if stage not in stages:
            continue
        try:
            owner = importlib.import_module(module_name)
            owner = getattr(owner, class_name) if class_name else owner
        except (ImportError, AttributeError) as err:
            problems.append(f"{module_name}.{class_name or ''} ({err})")
            continue
        for name, parameters in attributes.items():
            where = f"{module_name}.{class_name + '.' if class_name else ''}{name}"
            if not hasattr(owner, name):
                problems.append(f"{where} is missing")
            elif parameters:
                have = inspect.signature(getattr(owner, name)).parameters
                missing = [p for p in parameters if p not in have]
                if missing:
                    problems.append(f"{where} has no parameter {', '.join(missing)}")
    return problems


def check(stage: int) -> None:
    """Raise ``RuntimeError`` naming the versions (or the attributes) where this process runs a torch or DeepSpeed
    the package was not written for, at ZeRO stage ``stage``."""
    import deepspeed
    import torch
    found = {"torch": torch.__version__, "deepspeed": deepspeed.__version__}
    problems = version_problems(found)
    if problems:
        message = (f"deepspeed-compile supports {', '.join(f'{n} {r}' for n, r in SUPPORTED.items())}; this process "
                   f"runs {', '.join(problems)}. It rebinds and calls internals of both that change between "
                   f"releases. Install a supported release, or set {ALLOW_ENV}=1 to try this one at your own risk")
        if os.environ.get(ALLOW_ENV) != "1":
            raise RuntimeError(message)
        log.warning(message)
    missing = target_problems(stage)
    if missing:
        raise _lacks(missing)


def _lacks(missing: List[str]) -> RuntimeError:
    import deepspeed
    import torch
    return RuntimeError(f"deepspeed-compile: this torch {torch.__version__} / deepspeed {deepspeed.__version__} lacks "
                        f"what the package rebinds or calls: {'; '.join(missing)}")


def require_attributes(obj, names: Tuple[str, ...], what: str) -> None:
    """The attributes ``obj`` (``what``: a DeepSpeed object that sets them in its ``__init__``) must have: raise
    ``RuntimeError`` naming those it lacks, and the versions."""
    missing = [f"{what}.{name} is missing" for name in names if not hasattr(obj, name)]
    if missing:
        raise _lacks(missing)


def caller_locals(function: str, depth: int) -> Optional[dict]:
    """The local names of the nearest of the calling function's ``depth`` callers that runs a function named
    ``function`` (one of the ``TARGETS``: where DeepSpeed hands this package less than it needs, the rest is in its
    caller's frame), or None where none does."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == function:
            return frame.f_locals
        frame = frame.f_back
    return None
