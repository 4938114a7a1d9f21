# SPDX-License-Identifier: Apache-2.0
"""Memory plots of benchmark results (matplotlib, Agg): one timeline per configuration, one bar chart of peaks."""
import os
from typing import Any, Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MiB = float(1 << 20)
_PHASE_COLORS = {"forward": "#d8e8f8", "backward": "#f8e0d0", "optimizer": "#e0f0d8"}
_COLLECTIVE_COLORS = {"all-gather": "tab:blue", "reduce-scatter": "tab:green"}


def config_name(result: Dict[str, Any]) -> str:
    backend = result["backend"]
    return result["row"] if backend in ("-", None) else f"{result['row']}[{backend}]"


def file_stem(result: Dict[str, Any]) -> str:
    name = config_name(result).replace("+", "_").replace("[", "_").replace("]", "")
    return f"{result['model']}_{result['dtype']}_{name}"


def plot_timeline(result: Dict[str, Any], path: str) -> str:
    """Live tensor memory above the step start over one step, with forward/backward/optimizer shaded."""
    tl = result["timeline"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, start, end in tl["marks"]:
        if name in _PHASE_COLORS:
            ax.axvspan(start * 1e3, end * 1e3, color=_PHASE_COLORS[name], label=name, zorder=0)
    times = [t * 1e3 for t in tl["times_s"]]
    ax.step(times, [b / MiB for b in tl["live_bytes"]], where="post", color="black", lw=1.0,
            label="live tensor memory")
    boundaries = [start for name, start, _ in tl["marks"] if name == "backward"]
    if boundaries:
        ax.axvline(boundaries[-1] * 1e3, color="tab:red", ls="--", lw=1.0, label="forward | backward")
    gathered = result.get("gathered_timeline")
    if gathered:
        ax.fill_between([0.0] + [t * 1e3 for t in gathered["times_s"]], [0.0] + [b / MiB for b in gathered["live_bytes"]],
                        step="post", color="tab:purple", alpha=0.35, lw=0, label="gathered parameters (runtime)")
    elif result.get("peak_gathered_bytes"):
        ax.axhline(result["peak_gathered_bytes"] / MiB, color="tab:purple", ls=":", lw=1.2,
                   label="peak gathered params (runtime)")
    spans = result.get("collective_spans")
    if spans:
        # a band under the curve: one row per collective kind, a bar while each collective was in flight
        top = max([b / MiB for b in tl["live_bytes"]] + [0.0])
        height = max(top, 1e-3) * 0.04
        for row, (kind, color) in enumerate(_COLLECTIVE_COLORS.items()):
            bars = [(start * 1e3, (end - start) * 1e3) for k, start, end in spans if k == kind]
            if bars:
                ax.broken_barh(bars, (-(row + 1) * 1.3 * height, height), color=color, alpha=0.8,
                               label=f"{kind} in flight (runtime)")
    ax.set_xlabel("time in step (ms)")
    ax.set_ylabel("MiB above step start")
    ax.set_title(f"{result['model']} {result['dtype']} {config_name(result)}: "
                 f"peak {max(tl['live_bytes'], default=0) / MiB:.1f} MiB above start", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_peaks(results: List[Dict[str, Any]], path: str) -> str:
    """Per configuration: persistent bytes at the step start with the step's transient peak stacked on top."""
    results = [r for r in results if r.get("peak_above_start_bytes") is not None]
    labels = [f"{r['dtype']}\n{config_name(r)}" for r in results]
    persistent = [r["persistent_bytes"] / MiB for r in results]
    transient = [r["peak_above_start_bytes"] / MiB for r in results]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(results) + 2), 4.2))
    xs = range(len(results))
    ax.bar(xs, persistent, color="#9db4d0", label="live at step start")
    ax.bar(xs, transient, bottom=persistent, color="#e07b39", label="transient peak above start")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tensor memory per rank (MiB)")
    ax.set_title("peak tensor memory of one training step (rank 0)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: List[Dict[str, Any]], out_dir: str) -> List[str]:
    paths = [plot_timeline(r, os.path.join(out_dir, f"timeline_{file_stem(r)}.png"))
             for r in results if r.get("timeline")]
    if results:
        model = results[0]["model"]
        paths.append(plot_peaks(results, os.path.join(out_dir, f"peaks_{model}.png")))
    return paths
