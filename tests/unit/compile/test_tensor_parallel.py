# SPDX-License-Identifier: Apache-2.0
"""AutoTP's collectives placed in the compiled graphs (``"passes": ["autotp"]`` with ``tensor_parallel.autotp_size``,
``graph/tensor.py``) on a ``transformers`` Llama, its attention and MLP linears and its head sharded over 2 ranks by
DeepSpeed's AutoTP.

References, in one launch: eager ZeRO without tensor parallelism, both ranks fed the same batch (the unsplit model),
built first (DeepSpeed's tensor-parallel groups, once set up by an AutoTP engine, stay for the process); then, at
ZeRO-1 and at ZeRO-2 with Hugging Face's gradient checkpointing, DeepSpeed's own AutoTP run eagerly, with the same
shards (checkpointed alike). Tolerances: the losses within 1e-6 of the
unsplit model's (each row-parallel product is summed over the ranks where the unsplit model sums it in one pass: a
reordered fp32 sum); the parameters after three SGD steps within ``compare.FP32_REORDER_TOL`` of eager AutoTP's.
"""
import pytest
import torch

from distributed import run_distributed

LOSS_TOL = 1e-6
STEPS = 3


def _engine(stage: int, tp, compiled: bool, checkpointing: bool = False):
    import deepspeed
    from test_sequence import _model
    torch._dynamo.reset()
    model = _model("llama", checkpointing=checkpointing)
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
    # ZeRO-1; and ZeRO-2 with Hugging Face's gradient checkpointing (each decoder layer a checkpointed region, a body
    # graph of its own), against eager AutoTP checkpointed alike
    for case, stage, checkpointing in ((1, 1, False), (2, 2, True)):
        engine = _engine(stage, 2, True, checkpointing)
        losses, params = _train(engine)
        report = engine_report(engine)
        layers = [name for name, m in engine.module.named_modules() if getattr(m, "defer_collectives_to_compiler",
                                                                               False)]
        engine.destroy()
        eager_losses, eager_params = _train(_engine(stage, 2, False, checkpointing))
        out[case] = {"losses": losses, "params": params, "report": report, "deferred": layers,
                     "eager_losses": eager_losses, "eager_params": eager_params}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_cases, timeout_s=400)


@pytest.mark.parametrize("case", [1, 2], ids=["zero1", "zero2-checkpointing"])
def test_autotp_collectives_in_the_graphs_train_as_the_unsplit_model(results, case):
    """At ZeRO-1, and at ZeRO-2 under Hugging Face's gradient checkpointing, where every decoder layer's linears are
    traced in a checkpointed region's body graph and get their collectives there."""
    from compare import FP32_REORDER_TOL, max_rel_diff, rel_diffs
    for result in results:
        r = result[case]
        report = r["report"]
        # q, k, v, o, gate, up, down in each of 2 layers, and the head: 15 layers whose collectives the graphs place
        assert report is not None and report["tensor_parallel_size"] == 2, report
        assert report["tensor_parallel_layers"] == 15 and len(r["deferred"]) == 15, (report, r["deferred"])
        if case == 1:  # (a checkpointed backward recomputes each region first: its own order)
            # the input gradients of q/k/v, of gate/up in each layer, and of the head: each sum in flight over the
            # weight gradients (graph/tensor.py overlap_tensor_sums)
            assert report["tensor_sums_overlapped"] == 5, report
        assert max_rel_diff(r["losses"], result["unsplit"]) <= LOSS_TOL, (r["losses"], result["unsplit"])
        assert max_rel_diff(r["losses"], r["eager_losses"]) <= LOSS_TOL, (r["losses"], r["eager_losses"])
        diffs = rel_diffs(r["params"], r["eager_params"])
        assert max(diffs.values()) <= FP32_REORDER_TOL, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]


class LinearLayer(torch.nn.Linear):
    """Named as AutoTP's column-parallel layer: the placement finds AutoTP's layers by their class's name."""


class _NoProduct(LinearLayer):
    """An AutoTP layer, by name, whose traced code has no product to place its collective after."""

    def forward(self, x):
        return x * self.weight.sum()


_NoProduct.__name__ = "LinearLayer"  # (the placement reads the class's name)


class _Checkpointed(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.inner = layer

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False).sum()


def _traced(module):
    """The dynamo graph of ``module`` on an input of 8 features (run as traced; placement happens after)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend)(torch.randn(2, 8, requires_grad=True))
    torch._dynamo.reset()
    return graphs[0]


def test_a_layer_in_a_checkpointed_region_gets_its_collectives_there():
    """Placement walks the graphs nested in a dynamo graph: a layer traced in a checkpointed region's body gets its
    ``tp_enter`` in that body."""
    from deepspeed.compile.graph.tensor import place_tensor_collectives
    from deepspeed.compile.runtime import ops
    gm = _traced(_Checkpointed(LinearLayer(8, 8)))
    assert place_tensor_collectives(gm, 0) == 1
    bodies = [m for name, m in gm.named_modules() if name and isinstance(m, torch.fx.GraphModule)]
    assert len(bodies) == 1, bodies
    assert [n.target for n in bodies[0].graph.nodes].count(ops.TP_ENTER) == 1, bodies[0].code


def test_a_layer_traced_without_a_product_raises_naming_it():
    """A layer whose own collectives are switched off and that got none of the graph's would compute without them:
    placement raises, naming it."""
    from deepspeed.compile.graph.tensor import place_tensor_collectives
    gm = _traced(_Checkpointed(_NoProduct(8, 8)))
    with pytest.raises(RuntimeError, match="inner"):
        place_tensor_collectives(gm, 0)
