# SPDX-License-Identifier: Apache-2.0
"""Sequence parallelism (``"passes": ["autosp"]`` with ``sequence_parallel_size``, ``graph/sequence.py``) against the
same model trained without it.

The reference is eager ZeRO of the same stage in the same processes, each rank fed the batch of its sequence group
(the data-parallel index ``rank // sequence_parallel_size``): with every rank of a group fed one batch, eager ZeRO's
average over the group is that batch's own gradient, so it trains as the unsharded model does on one rank per group.
Each batch has a padded row (attention mask 0 on its first tokens, labels -100 there) and the length changes between
steps (one dynamic graph serves them). Tolerances: sequence parallelism sums each weight gradient over the
sequence in blocks, one per rank, then over the ranks, where the reference sums it in one pass; in fp32 that reorders
a sum of a few hundred terms (``compare.FP32_REORDER_TOL``, 1e-5 relative, norm-wise per parameter). The losses
differ by the same reordering of the cross-entropy's sum: 1e-6 relative.
"""
import operator

import pytest
import torch

from distributed import run_distributed

LOSS_TOL = 1e-6
LENGTHS = (16, 12, 20)  # one per step: divisible by 2 and 4


def _batch(step: int, group: int, length: int):
    g = torch.Generator().manual_seed(100 * step + group)
    ids = torch.randint(0, 96, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _model(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if name == "llama":  # grouped-query attention: 4 query heads, 2 key/value heads
        return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, attn_implementation="sdpa",
                                            use_cache=False))
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=64, bos_token_id=0,
                                      eos_token_id=0, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False))


def _engine(name: str, stage: int, sp: int, backend=None):
    import deepspeed
    from models import ds_config
    model = _model(name)
    config = ds_config(stage=stage, batch=2, optimizer="sgd", compile_section={"deepcompile": True, "passes": ["autosp"]}
                       if backend else None)
    if backend:
        config["sequence_parallel_size"] = sp
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    if backend:
        engine.compile(backend=backend)
    return engine


def _train(engine, sp: int, steps: int):
    """Losses of every step, and the full gradients after the first backward."""
    from compare import full_grads, full_params
    group = torch.distributed.get_rank() // sp
    losses, grads = [], None
    for step in range(steps):
        loss = engine(**_batch(step, group, LENGTHS[step % len(LENGTHS)])).loss
        engine.backward(loss)
        if grads is None:
            grads = full_grads(engine)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": full_params(engine)}


def _against_eager(name: str, stages, sp: int, steps: int, backend: str = "eager"):
    import deepspeed
    from deepspeed.compile.report import engine_report
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for stage in stages:
        torch._dynamo.reset()
        engine = _engine(name, stage, sp, backend)
        out[stage] = _train(engine, sp, steps)
        out[stage]["report"] = engine_report(engine)
        engine.destroy()
        reference = _engine(name, stage, sp)
        out[stage]["eager"] = _train(reference, sp, steps)
        reference.destroy()
    return out


def _check(result, stage):
    from compare import FP32_REORDER_TOL, max_rel_diff, rel_diffs
    r = result[stage]
    report = r["report"]
    assert report is not None and report["sequence_parallel_size"] > 1 and report["sequence_collectives"] > 0, report
    assert max_rel_diff(r["losses"], r["eager"]["losses"]) <= LOSS_TOL, (r["losses"], r["eager"]["losses"])
    grads = rel_diffs(r["grads"], r["eager"]["grads"])
    assert max(grads.values()) <= FP32_REORDER_TOL, (stage, "grads", sorted(grads.items(), key=lambda kv: -kv[1])[:3])
    params = rel_diffs(r["params"], r["eager"]["params"])
    assert max(params.values()) <= FP32_REORDER_TOL, (stage, "params", sorted(params.items(), key=lambda kv: -kv[1])[:3])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sequence_parallel_trains_as_the_unsharded_model(name):
    """2 ranks, one sequence group: ZeRO-3 and ZeRO-1 (Llama) or ZeRO-3 (GPT-2), against eager ZeRO."""
    stages = (3, 1) if name == "llama" else (3, )
    for result in run_distributed(_against_eager, name, stages, 2, len(LENGTHS), timeout_s=400):
        for stage in stages:
            _check(result, stage)


def _errors():
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    out = {}
    engine = _engine("llama", 3, 2, "eager")
    try:
        engine(**_batch(0, rank, 16))  # each rank a batch of its own
    except ValueError as err:
        out["different batches"] = str(err)
    engine.destroy()
    torch._dynamo.reset()
    engine = _engine("llama", 3, 2, "eager")
    try:
        engine(**_batch(0, 0, 15))
    except ValueError as err:
        out["odd length"] = str(err)
    engine.destroy()
    return out


def test_sequence_parallel_refuses_what_it_cannot_split():
    """A length the group's size does not divide, and ranks of one group fed different batches: a ValueError naming
    sequence_parallel_size on every rank, before any wrong result."""
    for r in run_distributed(_errors, timeout_s=300):
        assert "sequence_parallel_size=2" in r["different batches"] and "same batch" in r["different batches"], r
        assert "sequence_parallel_size=2" in r["odd length"] and "15" in r["odd length"], r


def test_sequence_parallel_at_4_ranks():
    """Two groups of 2 (sequence x data) and one group of 4 (more ranks than key/value heads: each rank's query
    heads get the key/value heads they read), at ZeRO-3."""
    for sp in (2, 4):
        for result in run_distributed(_against_eager, "llama", (3, ), sp, 2, world_size=4, timeout_s=500):
            _check(result, 3)


def test_the_rewrite_splits_every_layer():
    """Where the collectives go in a traced Llama: an all-to-all before each attention input and after attention,
    one all-reduce for the loss, one all-gather for the logits the model returns; nothing gathered inside a layer."""
    from deepspeed.compile.graph.sequence import shard_sequence
    from deepspeed.compile.runtime import ops
    seen = {}

    def backend(gm, example_inputs):
        collectives, cut = shard_sequence(gm, 0, 2, 1)
        seen["cut"] = cut
        seen["ops"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward

    model = _model("llama")
    batch = _batch(0, 0, 16)
    for tensor in batch.values():
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    with pytest.raises(Exception):  # the graph is not run: no sequence group exists in this process
        torch.compile(model, backend=backend)(**batch)
    torch._dynamo.reset()
    calls = seen["ops"]
    assert len(seen["cut"]) == 1, seen["cut"]
    assert calls.count(ops.SEQ_ALL_TO_ALL) == 4 * 2, calls.count(ops.SEQ_ALL_TO_ALL)
    assert calls.count(ops.SEQ_ALL_REDUCE) == 1
    assert calls.count(ops.SEQ_ALL_GATHER) == 1  # the logits returned
    gather_at = calls.index(ops.SEQ_ALL_GATHER)
    assert gather_at > max(i for i, t in enumerate(calls) if t is ops.SEQ_ALL_TO_ALL)
    assert operator.floordiv in calls
