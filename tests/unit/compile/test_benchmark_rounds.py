# SPDX-License-Identifier: Apache-2.0
"""The benchmark's statistics over interleaved rounds (``benchmarks/run.py --rounds``), on made-up results
(single process, no launch). Like ``test_memory_measure.py``, a test of benchmark code importing ``benchmarks/``.
"""
import sys

import pytest

from checkout import REPO_ROOT

sys.path.insert(0, REPO_ROOT)
from benchmarks.run import _per_round, check_losses, merge_rounds, parse_args, phase_table, ratios, table  # noqa: E402


def _result(row: str, median: float, loss: float = 7.0, dtype: str = "fp32") -> dict:
    return {"row": row, "backend": "-" if row in ("zero3", "local") else "eager", "dtype": dtype,
            "median_step_s": median, "final_loss": loss, "peak_above_start_bytes": 1 << 20}


def test_merged_step_is_the_median_of_the_rounds_and_the_rest_is_the_first_round():
    runs = [_result("zero3", m) for m in (0.9, 0.5, 0.6)]
    runs[0]["peak_above_start_bytes"] = 123
    merged = merge_rounds(runs)
    assert merged["median_step_s"] == 0.6
    assert merged["round_medians_s"] == [0.9, 0.5, 0.6]
    assert merged["peak_above_start_bytes"] == 123
    assert merge_rounds(runs[:1]) == runs[0]  # one round: the launch's own record
    failed = {"row": "zero3", "error": "exit 1"}
    assert merge_rounds([runs[0], failed]) is failed  # a failed round fails the configuration


def test_phases_and_waits_are_merged_per_part():
    runs = [_result("ours-mincut", m) for m in (0.9, 0.5, 0.6)]
    for r, (fw, bw, wait) in zip(runs, ((0.3, 0.5, 0.02), (0.1, 0.3, 0.04), (0.2, 0.4, 0.03))):
        r["phase_medians_s"] = {"forward": fw, "backward": bw, "optimizer": 0.1}
        r["wait_per_step_s"] = {"gather": wait, "reduce": 2 * wait}
    merged = merge_rounds(runs)
    assert merged["phase_medians_s"] == {"forward": 0.2, "backward": 0.4, "optimizer": 0.1}
    assert merged["wait_per_step_s"] == {"gather": 0.03, "reduce": 0.06}
    eager = _result("zero3", 0.7)
    eager["phase_medians_s"] = {"forward": 0.25, "backward": 0.35, "optimizer": 0.1}
    table = phase_table([merged, eager, {"row": "fsdp2", "error": "exit 1"}])
    assert "| fp32 | ours-mincut[eager] | 0.600 | 0.200 | 0.400 | 0.100 | 0.030 | 0.060 |" in table
    assert "| fp32 | zero3 | 0.700 | 0.250 | 0.350 | 0.100 | - | - |" in table
    assert "fsdp2" not in table


def test_ratio_per_round_pairs_the_launches_of_one_round():
    ours = merge_rounds([_result("ours-mincut", m) for m in (0.4, 0.9, 0.5)])
    base = merge_rounds([_result("zero3", m) for m in (0.5, 1.0, 0.4)])
    text = _per_round(ours, base)
    assert "rounds: 0.80, 0.90, 1.25" in text
    assert "median of rounds 0.90x" in text
    assert _per_round(merge_rounds([_result("zero3", 0.5)]), base) == ""  # one round: no per-round column


def test_every_printed_ratio_is_ours_over_the_baseline():
    """One convention in everything the benchmarks print: ours / baseline, below 1 better."""
    results = [_result("zero3", 0.5), _result("ours-mincut", 0.4)]
    results[1]["peak_above_start_bytes"] = 1 << 19
    check_losses(results)
    for r in results:
        r.update(first_step_s=1.0, peak_bytes=None, saved_param_bytes=None, saved_other_bytes=None,
                 allgather_bytes_per_step=None, reduce_scatter_bytes_per_step=None)
    assert "| step / zero3 step |" in table(results)
    assert "| fp32 | ours-mincut[eager] | 0.400 | 0.80x |" in table(results)
    assert "ours-mincut[eager] / zero3: step 0.80x, peak above start 0.50x" in ratios(results)
    from benchmarks.steady_step import paired_ratio
    text = paired_ratio([0.4, 0.4, 0.4], [0.5, 0.5, 0.5])  # the row under test first, its step shorter
    assert "the first row's step over this row's, per batch: median 0.800x (95% 0.800-0.800)" in text


def test_the_local_floor_is_not_loss_checked_nor_the_reference():
    results = [_result("local", 0.2, loss=3.0), _result("zero3", 0.5), _result("ours-mincut", 0.4, loss=7.0 + 1e-9)]
    check_losses(results)
    local, zero3, ours = results
    assert local["loss_check"] == "n/a"
    assert zero3["loss_check"] == ours["loss_check"] == "ok"
    assert ours["loss_ref"] == "zero3"
    assert local["step_vs_zero3"] == pytest.approx(0.4)  # ours / baseline: the floor's shorter step is below 1
    results = [_result("local", 0.2, loss=3.0), _result("ours-mincut", 0.4, loss=7.0), _result("fsdp2", 0.4, loss=9.0)]
    check_losses(results)  # without zero3 the first checked row is the reference, never the floor
    assert results[1]["loss_check"] == "ok" and results[2]["loss_check"] == "FAILED"


@pytest.mark.parametrize("dtype, inside, outside", [("fp32", 5e-5, 2e-4), ("bf16", 1e-2, 3e-2),
                                                    ("autocast", 1e-2, 3e-2)])
def test_loss_tolerance_is_the_dtype_s(dtype, inside, outside):
    """Just inside and just outside each dtype's relative tolerance (fp32 1e-4, bf16 and autocast 2e-2)."""
    for rel, verdict in ((inside, "ok"), (outside, "FAILED")):
        results = [_result("zero3", 0.5, dtype=dtype), _result("ours-mincut", 0.4, loss=7.0 * (1 + rel), dtype=dtype)]
        check_losses(results)
        assert results[1]["loss_check"] == verdict, (dtype, rel, results[1])


def test_every_round_s_loss_is_checked():
    zero3 = merge_rounds([_result("zero3", 0.5), _result("zero3", 0.5)])
    ours = merge_rounds([_result("ours-mincut", 0.4), _result("ours-mincut", 0.4, loss=7.5)])  # one launch diverged
    check_losses([zero3, ours])
    assert ours["loss_check"] == "FAILED"
    assert ours["loss_rel_diff"] == pytest.approx(0.5 / 7.0)


def test_rounds_below_one_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
    assert "--rounds: must be at least 1, got 0" in capsys.readouterr().err  # not only the usage line


def test_steady_step_overrides_are_one_object_for_every_row_or_one_per_row(capsys):
    import argparse
    from benchmarks.steady_step import per_row
    parser = argparse.ArgumentParser()
    rows = ["ours-zero2", "zero2+compile"]
    assert per_row(parser, "--zero", '{"reduce_bucket_size": 5}', rows) == [{"reduce_bucket_size": 5}] * 2
    assert per_row(parser, "--zero", '[{}, {"overlap_comm": true}]', rows) == [{}, {"overlap_comm": True}]
    for bad in ('[{}]', '[{}, 1]', '3', '{"a": '):
        with pytest.raises(SystemExit):
            per_row(parser, "--zero", bad, rows)
        assert "--zero" in capsys.readouterr().err


def test_steady_step_reduction_timeline_is_summarized_by_position_over_steps():
    from benchmarks.steady_step import summarize_timeline
    steps = [[(0.10, 0.02), (0.30, 0.01)],
             [(0.12, 0.04), (0.28, 0.03)],
             [(0.11, 0.03), (0.35, 0.02)],
             [(0.20, 0.05)]]  # a step with one reduction fewer: left out of the positions, kept in the total
    positions, total = summarize_timeline(steps)
    assert positions == [(0.11, 0.03), (0.30, 0.02)]
    assert total == pytest.approx(0.05)  # median of 0.03, 0.07, 0.05, 0.05


def test_steady_step_median_interval_holds_the_median_and_narrows_with_agreeing_batches():
    from benchmarks.steady_step import median_interval
    spread = [0.90, 0.95, 1.00, 1.02, 1.04, 1.06, 1.10, 1.20]
    low, high = median_interval(spread)
    assert 0.90 <= low <= 1.03 <= high <= 1.20 and low < high  # the sample median 1.03 lies inside
    assert median_interval(spread) == (low, high)  # seeded: the same figures again
    tight = [1.03, 1.031, 1.029, 1.03, 1.032, 1.028, 1.03, 1.03]
    t_low, t_high = median_interval(tight)
    assert 1.028 <= t_low <= 1.03 <= t_high <= 1.032 and t_high - t_low < high - low


def test_steady_step_comm_summary_is_per_timed_step_and_only_for_deepcompile_rows():
    from benchmarks.steady_step import comm_summary
    before = {"gather_seconds": 1.0, "allgather_collectives": 100, "reduce_wait_seconds": 0.5, "reduce_collectives": 10}
    after = {"gather_seconds": 1.2, "allgather_collectives": 140, "reduce_wait_seconds": 0.54, "reduce_collectives": 20,
             "graphs_compiled": 2}
    assert comm_summary(before, after, 4) == ("; per step: all-gather wait 50.0 ms (10 collectives), "
                                              "reduce wait 10.0 ms (2 collectives); forward graphs compiled: 2")
    zero2 = {"reduce_wait_seconds": 0.0, "reduce_collectives": 0}  # ZeRO-1/2 reports have no gathers
    assert comm_summary(zero2, {"reduce_wait_seconds": 0.3, "reduce_collectives": 15, "graphs_compiled": 1}, 3) == \
        "; per step: reduce wait 100.0 ms (5 collectives); forward graphs compiled: 1"
    assert comm_summary(None, None, 4) == ""  # eager DeepSpeed, FSDP2 and local rows


@pytest.mark.parametrize("phase, inside, outside", [("forward", "aten::sin", "aten::cos"),
                                                     ("backward", "aten::cos", "aten::sin")])
def test_steady_step_aten_profile_counts_the_named_phase_only(phase, inside, outside):
    import torch
    from benchmarks.steady_step import phase_ops
    x = torch.ones(8, requires_grad=True)
    steps = []
    fns = (lambda batch: (x * batch).sin().sum(), lambda loss: loss.backward(), lambda: steps.append(1))
    ops = {name: calls for name, calls, seconds in phase_ops(fns, [2.0, 3.0], phase)}
    assert ops[inside] == 2 and outside not in ops  # sin runs in forward; its backward runs cos
    assert len(steps) == 2  # every phase ran, profiled or not


def test_labels_has_a_transformers_model_compute_its_own_shifted_loss():
    """``--labels``: the model's own loss (Hugging Face's: targets shifted by one token), not the benchmark's loss on
    the logits; refused, naming the option, for the benchmark's own GPT."""
    import torch
    import torch.nn.functional as F
    from benchmarks.models import make_batch, make_model
    idx, targets = make_batch("small", 0, 0)
    own, plain = make_model("gpt2", "small", labels=True), make_model("gpt2", "small")
    logits = plain.model(input_ids=idx, use_cache=False).logits
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets[:, 1:].reshape(-1))
    assert torch.allclose(own(idx, targets), shifted, rtol=1e-6, atol=0)
    assert not torch.allclose(plain(idx, targets), shifted, rtol=1e-3, atol=0)  # the default: unshifted
    with pytest.raises(ValueError, match="labels"):
        make_model("gpt", "small", labels=True)


@pytest.mark.parametrize("adam, torch_adam", [("torch", True), ("deepspeed", None)])
def test_adam_setting_reaches_every_worker_s_deepspeed_config(adam, torch_adam):
    """``run.py --adam`` is handed to each worker (``setting_argv``) and decides the DeepSpeed rows' optimizer
    section: torch's AdamW, or the section a user naming only AdamW writes (DeepSpeed then builds its FusedAdam)."""
    from benchmarks.worker import LR, ds_config, parse_args as worker_args, setting_argv
    args = parse_args(["--adam", adam])
    row = worker_args(["--row", "zero3", *setting_argv(args)])
    assert row.adam == adam
    config = ds_config("fp32", 1000, 2, None, row.zero_settings, adam=row.adam)
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": LR, **({"torch_adam": True} if torch_adam else {})}}
