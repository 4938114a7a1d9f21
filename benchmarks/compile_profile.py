# SPDX-License-Identifier: Apache-2.0
"""Where the first step's time goes: dynamo, AOTAutograd, our passes, inductor's lowering, code generation and the
C++ compile, read from torch's own compile timers (``torch._dynamo.utils.compilation_time_metrics``, which every
``dynamo_timed`` phase adds to) and the DeepCompile report's per-pass seconds.

The worker records the raw timers after step 0 (``record``); ``python benchmarks/run.py --compile-profile`` prints
one table of phases per configuration (``table``). Phases nest: dynamo's frame compile contains the backend call,
which contains AOTAutograd, which contains the forward graph's compile; the backward graph is compiled in step 0's
backward; inductor's C++ compile happens while it loads the generated module. The table reports exclusive times,
so the phase rows add up to the first step.
"""
from typing import Any, Dict, List

# torch 2.13's dynamo_timed keys
_FRAME = "_compile.compile_inner"  # dynamo: trace a frame, build guards, call the backend
_BACKEND = "OutputGraph.call_user_compiler"  # the backend (AOTAutograd and what it calls)
_AOT = "create_aot_dispatcher_function"  # AOTAutograd: joint trace, partition, forward compile
_INDUCTOR = "compile_fx_inner"  # inductor, per graph (forward and backward)
_FW = "compile_fx.<locals>.fw_compiler_base"  # torch.compile's own forward / backward compilers (inductor)
_BW = "compile_fx.<locals>.bw_compiler"
_LOWERING = "GraphLowering.run"  # FX graph -> inductor IR
_POST_GRAD = "_recursive_post_grad_passes"  # inductor's own FX passes on the partitioned graphs
# scheduling and fusion, kernel and wrapper code generation, the C++ compile of the kernels and loading the module
# (torch's compile_file timer covers only part of the C++ compiles, some run inside codegen: one phase here)
_TO_MODULE = "GraphLowering.compile_to_module"

_KERNELS = "count:kernels generated"  # inductor's generated (fused) kernels, before it deduplicates identical ones
_IR_NODES = "count:IR nodes before fusion"

PHASES = ("dynamo", "AOTAutograd", "partition", "our passes", "inductor lowering", "inductor post-grad passes",
          "inductor codegen + C++ compile + load", "inductor other", "compiler glue", "running step 0")


def record() -> Dict[str, float]:
    """Seconds per torch compile timer so far in this process, and ``calls:<timer>``: how often it ran (for
    ``compile_fx_inner``, the graphs inductor compiled; for ``_compile.compile_inner``, the frames dynamo compiled),
    and inductor's counts of generated kernels and IR nodes."""
    from torch._dynamo.utils import compilation_time_metrics
    out = {key: float(sum(values)) for key, values in compilation_time_metrics.items()}
    out.update({f"calls:{key}": float(len(values)) for key, values in compilation_time_metrics.items()})
    from torch._inductor import metrics  # process-wide counters inductor adds to as it generates code
    out[_KERNELS] = float(metrics.generated_kernel_count)
    out[_IR_NODES] = float(metrics.ir_nodes_pre_fusion)
    return out


def phases(timers: Dict[str, float], report: Dict[str, Any], first_step_s: float) -> Dict[str, float]:
    """Exclusive seconds per phase of the first step; they add up to ``first_step_s``. ``report``: the DeepCompile
    engine report (its per-pass and per-direction compile seconds), empty for other rows."""
    t = lambda key: timers.get(key, 0.0)  # noqa: E731
    compile_seconds = report.get("compile_seconds") or {}
    forward = compile_seconds.get("forward", t(_FW))  # the graph compilers AOTAutograd calls
    backward = compile_seconds.get("backward", t(_BW))  # in step 0's backward, outside dynamo's frame
    ours = sum((report.get("pass_seconds") or {}).values())
    partition = compile_seconds.get("partition", 0.0)  # our tagging and torch's partitioner, inside AOTAutograd
    inductor = t(_INDUCTOR)
    out = {
        "dynamo": t(_FRAME) - t(_BACKEND),
        "AOTAutograd": t(_BACKEND) - forward - partition,
        "partition": partition,
        "our passes": ours,
        "inductor lowering": t(_LOWERING),
        "inductor post-grad passes": t(_POST_GRAD),
        "inductor codegen + C++ compile + load": t(_TO_MODULE),
        "inductor other": inductor - t(_LOWERING) - t(_POST_GRAD) - t(_TO_MODULE),
        "compiler glue": forward + backward - ours - inductor,
        "running step 0": first_step_s - t(_FRAME) - backward,
    }
    return out


def table(results: List[Dict[str, Any]]) -> str:
    """One row per phase, one column per configuration that recorded its timers."""
    from benchmarks.plots import config_name
    rows = [r for r in results if r.get("compile_timers") is not None]
    if not rows:
        return ""
    split = [phases(r["compile_timers"], r.get("report") or {}, r["first_step_s"]) for r in rows]
    head = "| phase (s) | " + " | ".join(f"{r['dtype']} {config_name(r)}" for r in rows) + " |"
    lines = [head, "|" + "---|" * (len(rows) + 1)]
    for phase in PHASES:
        lines.append(f"| {phase} | " + " | ".join(f"{s[phase]:.2f}" for s in split) + " |")
    lines.append("| **first step** | " + " | ".join(f"**{r['first_step_s']:.2f}**" for r in rows) + " |")
    for label, key in (("frames dynamo compiled", _FRAME), ("graphs inductor compiled", _INDUCTOR)):
        lines.append(f"| {label} | " + " | ".join(f"{r['compile_timers'].get('calls:' + key, 0):.0f}" for r in rows)
                     + " |")
    for label, key in (("kernels inductor generated", _KERNELS), ("IR nodes before fusion", _IR_NODES)):
        lines.append(f"| {label} | " + " | ".join(f"{r['compile_timers'].get(key, 0):.0f}" for r in rows) + " |")
    return "\n".join(lines)
