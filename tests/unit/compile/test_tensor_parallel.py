# SPDX-License-Identifier: Apache-2.0
"""AutoTP's collectives placed in the compiled graphs (``"passes": ["autotp"]`` with ``tensor_parallel.autotp_size``,
``graph/tensor.py``) on a ``transformers`` Llama, its attention and MLP linears and its head sharded over 2 ranks by
DeepSpeed's AutoTP.

References, in one launch: eager ZeRO without tensor parallelism, both ranks fed the same batch (the unsplit model),
built first (DeepSpeed's tensor-parallel groups, once set up by an AutoTP engine, stay for the process); then, per
ZeRO stage, DeepSpeed's own AutoTP run eagerly, with the same shards. Tolerances: the losses within 1e-6 of the
unsplit model's (each row-parallel product is summed over the ranks where the unsplit model sums it in one pass: a
reordered fp32 sum); the parameters after three SGD steps within ``compare.FP32_REORDER_TOL`` of eager AutoTP's.
"""
import pytest
import torch

from distributed import run_distributed

LOSS_TOL = 1e-6
STEPS = 3


def _engine(stage: int, tp, compiled: bool):
    import deepspeed
    from test_sequence import _model
    torch._dynamo.reset()
    model = _model("llama")
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.3}},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    if tp:
        config["tensor_parallel"] = {"autotp_size": tp}
    if compiled:
        config["compile"] = {"deepcompile": True, "passes": ["autotp"]}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    if compiled:
        engine.compile(backend="eager")
    return engine


def _train(engine):
    from test_sequence import _batch
    losses = []
    for step in range(STEPS):
        loss = engine(**_batch(step, 0, 16)).loss  # the same batch on both ranks
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return losses, params


def _cases():
    import deepspeed
    from deepspeed.compile.report import engine_report
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"unsplit": _train(_engine(1, None, False))[0]}
    for stage in (1, 2):
        engine = _engine(stage, 2, True)
        losses, params = _train(engine)
        report = engine_report(engine)
        layers = [name for name, m in engine.module.named_modules() if getattr(m, "defer_collectives_to_compiler",
                                                                               False)]
        engine.destroy()
        eager_losses, eager_params = _train(_engine(stage, 2, False))
        out[stage] = {"losses": losses, "params": params, "report": report, "deferred": layers,
                      "eager_losses": eager_losses, "eager_params": eager_params}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_cases, timeout_s=400)


@pytest.mark.parametrize("stage", [1, 2])
def test_autotp_collectives_in_the_graphs_train_as_the_unsplit_model(results, stage):
    from compare import FP32_REORDER_TOL, max_rel_diff, rel_diffs
    for result in results:
        r = result[stage]
        report = r["report"]
        # q, k, v, o, gate, up, down in each of 2 layers, and the head: 15 layers whose collectives the graphs place
        assert report is not None and report["tensor_parallel_size"] == 2, report
        assert report["tensor_parallel_layers"] == 15 and len(r["deferred"]) == 15, (report, r["deferred"])
        # the input gradients of q/k/v, of gate/up in each layer, and of the head: each sum in flight over the
        # weight gradients (graph/tensor.py overlap_tensor_sums)
        assert report["tensor_sums_overlapped"] == 5, report
        assert max_rel_diff(r["losses"], result["unsplit"]) <= LOSS_TOL, (r["losses"], result["unsplit"])
        assert max_rel_diff(r["losses"], r["eager_losses"]) <= LOSS_TOL, (r["losses"], r["eager_losses"])
        diffs = rel_diffs(r["params"], r["eager_params"])
        assert max(diffs.values()) <= FP32_REORDER_TOL, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
