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
LENGTHS = (16, 12, 20)  # one per step (the first three): divisible by 2 and 4


def _batch(step: int, group: int, length: int):
    g = torch.Generator().manual_seed(100 * step + group)
    ids = torch.randint(0, 96, (2, length), generator=g)
    mask = torch.ones_like(ids)
    if step != 1:  # left padding in the second row; none at step 1, where the mask is the causal one
        mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class SequencePool(torch.nn.Module):
    """Token embeddings scaled by a softmax over the sequence (each position's weight among all the row's positions,
    times the sequence's length: a length used as a value), then a head and the cross-entropy of its logits, with no
    attention: the softmax reads the whole sequence."""

    def __init__(self, vocab: int = 96, dim: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.score = torch.nn.Linear(dim, 1, bias=False)  # (a softmax ignores a shift: a bias's gradient is 0)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        from transformers.modeling_outputs import CausalLMOutput
        h = self.embed(input_ids)
        weights = torch.softmax(self.score(h), dim=1)  # [batch, seq, 1]: over the sequence
        logits = self.head(torch.softmax(h, dim=-1) * weights * h.shape[1])  # this softmax over the features
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def _model(name: str, layers: int = 2, checkpointing: bool = False):
    """``checkpointing``: with Hugging Face's gradient checkpointing (every decoder layer a checkpointed region)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if name == "pool":
        return SequencePool()
    if name == "llama" and checkpointing:
        model = _model(name, layers)
        model.gradient_checkpointing_enable()
        return model.train()
    if name == "llama":  # grouped-query attention: 4 query heads, 2 key/value heads
        return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, attn_implementation="sdpa",
                                            use_cache=False))
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=96, n_positions=64, bos_token_id=0,
                                      eos_token_id=0, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False))


def _engine(name: str, stage: int, sp: int, backend=None, dtype: str = "fp32", layers: int = 2,
            checkpointing: bool = False, **section):
    import deepspeed
    from models import ds_config
    model = _model(name, layers, checkpointing)
    config = ds_config(stage=stage, batch=2, optimizer="sgd", dtype=dtype,
                       compile_section={"deepcompile": True, "passes": ["autosp"], **section} if backend else None)
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


def _against_eager(name: str, stage: int, sp: int, steps: int, backend: str = "eager", layers: int = 2,
                   checkpointing: bool = False):
    """The split model and eager ZeRO of the same stage, trained alike."""
    from deepspeed.compile.report import engine_report
    torch._dynamo.reset()
    engine = _engine(name, stage, sp, backend, layers=layers, checkpointing=checkpointing)
    out = _train(engine, sp, steps)
    out["report"] = engine_report(engine)
    out["layers"] = layers
    engine.destroy()
    reference = _engine(name, stage, sp, layers=layers, checkpointing=checkpointing)
    out["eager"] = _train(reference, sp, steps)
    reference.destroy()
    return out


def _bf16(fp32_eager_grads):
    """One bf16 step of the split model and of eager ZeRO-3: their first gradients, with eager ZeRO-3's fp32 ones."""
    grads = {"fp32": fp32_eager_grads}
    for key, backend in (("sp", "eager"), ("eager", None)):
        torch._dynamo.reset()
        engine = _engine("llama", 3, 2, backend, "bf16")
        grads[key] = _train(engine, 2, 1)["grads"]
        engine.destroy()
    return grads


def _errors():
    """What a split engine raises for ranks fed different batches (its first call), then for a length 2 does not
    divide; then the loss of a batch it can split: a refused batch leaves the engine as it was."""
    rank = torch.distributed.get_rank()
    out = {}
    torch._dynamo.reset()
    engine = _engine("llama", 3, 2, "eager")
    for case, batch in (("different batches", _batch(0, rank, 16)), ("odd length", _batch(0, 0, 15))):
        try:
            engine(**batch)
        except ValueError as err:
            out[case] = str(err)
    out["loss after"] = engine(**_batch(0, 0, 16)).loss.item()
    engine.destroy()
    return out


def _compile_fails_on_rank_1():
    """ZeRO-0 with the sequence split: rank 1's forward compile fails (an injected error), rank 0's succeeds and
    its graph starts with an all-to-all on the sequence group. Both must stop in that step, then train unsplit."""
    import time
    from deepspeed.compile.driver import compiler
    rank = torch.distributed.get_rank()
    torch._dynamo.reset()
    original = compiler.GraphCompiler._compile_forward
    if rank == 1:
        def broken(self, gm, example_inputs):
            raise RuntimeError("an injected forward compile failure")
        compiler.GraphCompiler._compile_forward = broken
    try:
        # a broken agreement fails, not hangs; one layer: only the first all-to-all matters here
        engine = _engine("llama", 0, 2, "eager", layers=1, collective_timeout_s=60)
        start = time.monotonic()
        try:
            engine(**_batch(0, 0, 16))
            raised = None
        except Exception as err:
            raised = f"{type(err).__name__}: {err}"
        seconds = time.monotonic() - start
    finally:
        compiler.GraphCompiler._compile_forward = original
    out = {"raised": raised, "seconds": seconds, "active": engine.is_deepcompile_active()}
    out["losses"] = _train(engine, 2, 1)["losses"]  # fed the group's batch: the same on both ranks
    engine.destroy()
    return out


def _two_ranks(steps):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    out = {("llama", 3): _against_eager("llama", 3, 2, steps), ("llama", 1): _against_eager("llama", 1, 2, steps),
           ("gpt2", 3): _against_eager("gpt2", 3, 2, steps), ("llama", 0): _against_eager("llama", 0, 2, steps),
           # one layer under inductor: its cold C++ compiles are the launch's largest cost (35 s against 47 s for two)
           ("llama", 3, "inductor"): _against_eager("llama", 3, 2, steps, "inductor", layers=1)}
    out["bf16"] = _bf16(out[("llama", 3)]["eager"]["grads"])
    out["errors"] = _errors()
    out["compile failure"] = _compile_fails_on_rank_1()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """One launch of 2 ranks (one sequence group) for the tests below: engines are built one after the other."""
    return run_distributed(_two_ranks, len(LENGTHS), timeout_s=570)


def _with_whole_op_warnings(run):
    """``run()``'s result, with the warnings DeepSpeed's logger gave while it ran that name ops run whole."""
    import logging
    from deepspeed.utils import logger
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            if "ran these ops on the whole sequence" in record.getMessage():
                seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        out = run()
    finally:
        logger.removeHandler(handler)
    out["whole_op_warnings"] = seen
    return out


def _two_ranks_more(steps):
    """ZeRO-1: a model with a softmax over the sequence, and the Llama under Hugging Face's gradient checkpointing,
    with the warnings each gave about ops run whole."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    # no attention layer in the first: no mask decided at run time
    return {("pool", 1): _with_whole_op_warnings(lambda: _against_eager("pool", 1, 2, steps, layers=0)),
            ("llama", 1, "checkpointing"): _with_whole_op_warnings(
                lambda: _against_eager("llama", 1, 2, steps, checkpointing=True))}


@pytest.fixture(scope="module")
def two_ranks_more():
    """A second launch of 2 ranks: the first is at its time limit."""
    return run_distributed(_two_ranks_more, len(LENGTHS), timeout_s=400)


def _check(r, whole_ops=None, run_time_masks=None):
    """``whole_ops``: the ops the model runs on the whole sequence (none in a transformer whose every layer is split);
    ``run_time_masks``: the attentions whose mask is decided per run (each layer's, unless said)."""
    from compare import FP32_REORDER_TOL, max_rel_diff, rel_diffs
    report = r["report"]
    assert report is not None and report["sequence_parallel_size"] > 1 and report["sequence_collectives"] > 0, report
    assert report["sequence_whole_ops"] == (whole_ops or {}), report["sequence_whole_ops"]
    # each layer's mask (symbolic length) is decided per run
    assert report["run_time_masks"] == (r["layers"] if run_time_masks is None else run_time_masks), report
    assert max_rel_diff(r["losses"], r["eager"]["losses"]) <= LOSS_TOL, (r["losses"], r["eager"]["losses"])
    grads = rel_diffs(r["grads"], r["eager"]["grads"])
    assert max(grads.values()) <= FP32_REORDER_TOL, ("grads", sorted(grads.items(), key=lambda kv: -kv[1])[:3])
    params = rel_diffs(r["params"], r["eager"]["params"])
    assert max(params.values()) <= FP32_REORDER_TOL, ("params", sorted(params.items(), key=lambda kv: -kv[1])[:3])


@pytest.mark.parametrize("case", [("llama", 3), ("llama", 1), ("llama", 0), ("gpt2", 3), ("llama", 3, "inductor")],
                         ids=["llama-zero3", "llama-zero1", "llama-zero0", "gpt2-zero3", "llama-zero3-inductor"])
def test_sequence_parallel_trains_as_the_unsharded_model(two_ranks, case):
    """2 ranks, one sequence group, against eager ZeRO of the same stage (the eager backend, and inductor, whose fp32
    reordering the same tolerance covers: ``compare.FP32_REORDER_TOL``)."""
    for result in two_ranks:
        _check(result[case])


def test_sequence_parallel_splits_every_checkpointed_layer(two_ranks_more):
    """Hugging Face's gradient checkpointing: each decoder layer is a checkpointed region, a body graph of its own in
    the dynamo graph, rewritten there: every layer split (nothing run on the whole sequence; the all-to-alls of q, k, v
    and the attention's output in each of 2 layers, the loss's sum and the logits' gather), and the model trains as
    the unsplit one. The attentions inside the regions keep the mask the model built (none is decided at run time:
    that pass reads the top-level graph)."""
    for result in two_ranks_more:
        r = result[("llama", 1, "checkpointing")]
        _check(r, run_time_masks=0)
        assert r["report"]["sequence_collectives"] == 4 * 2 + 2, r["report"]
        assert r["whole_op_warnings"] == [], r["whole_op_warnings"]


def test_a_softmax_over_the_sequence_runs_on_the_whole_sequence(two_ranks_more):
    """A softmax over the sequence dimension of a block normalizes over every position of the row: its input is
    gathered (one softmax counted in the report, the only op run whole: the softmax over the features stays split;
    one warning names it, over three steps), and the model trains as the unsplit one."""
    for result in two_ranks_more:
        r = result[("pool", 1)]
        _check(r, whole_ops={"softmax": 1})
        assert len(r["whole_op_warnings"]) == 1 and "softmax (x1)" in r["whole_op_warnings"][0], r["whole_op_warnings"]


def test_sequence_parallel_in_bf16_is_as_accurate_as_eager_zero3(two_ranks):
    """bf16: the split model's first gradients differ from eager ZeRO-3's bf16 gradients by at most twice eager's
    own bf16 error (its difference from the fp32 gradients), per parameter (``compare.bf16_grad_bounds``)."""
    from compare import bf16_grad_bounds, rel_diffs
    for result in two_ranks:
        r = result["bf16"]
        bounds = bf16_grad_bounds(r["eager"], r["fp32"])
        diffs = rel_diffs(r["sp"], r["eager"])
        over = {name: (diffs[name], bounds[name]) for name in diffs if diffs[name] > bounds[name]}
        assert not over, over


def test_sequence_parallel_refuses_what_it_cannot_split(two_ranks):
    """Ranks of one group fed different batches, and a length the group's size does not divide: a ValueError naming
    sequence_parallel_size on every rank, before any wrong result; the engine then computes the loss of a batch it
    can split as a fresh one does."""
    for result in two_ranks:
        r = result["errors"]
        assert "sequence_parallel_size=2" in r["different batches"] and "same batch" in r["different batches"], r
        assert "sequence_parallel_size=2" in r["odd length"] and "15" in r["odd length"], r
        assert r["loss after"] == result[("llama", 3)]["losses"][0], (r["loss after"], result[("llama", 3)]["losses"])


def test_one_ranks_compile_failure_stops_both_ranks_of_the_sequence_group(two_ranks):
    """The sequence group's first all-to-all waits for the ranks' agreement that each runs its graph, so the rank
    whose compile failed stops its peer there, naming itself, within seconds (not the process group's 30 minutes);
    both then run the same unsplit steps."""
    peer, own = (r["compile failure"] for r in two_ranks)  # rank 1 failed
    assert peer["raised"] and "StepAbandoned" in peer["raised"] and "rank 1 failed" in peer["raised"], peer
    assert "injected forward compile failure" in peer["raised"], peer
    assert own["raised"] and "injected forward compile failure" in own["raised"], own
    assert not own["active"] and not peer["active"] and max(own["seconds"], peer["seconds"]) < 60, (own, peer)
    assert own["losses"] == peer["losses"], (own["losses"], peer["losses"])


def _four_ranks(steps):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    # one layer: 4 ranks time-share 2 cores here, and every layer is split alike (the 2-rank cases have two)
    return {(stage, sp): _against_eager("llama", stage, sp, steps, layers=1) for stage, sp in FOUR_RANK_CASES}


FOUR_RANK_CASES = ((3, 2), (0, 4), (1, 4), (3, 4))  # (ZeRO stage, sequence_parallel_size)


def test_sequence_parallel_at_4_ranks():
    """Two groups of 2 (sequence x data) at ZeRO-3, where ZeRO shards over all 4 ranks; one group of 4 at ZeRO-0, 1
    and 3 (more ranks than key/value heads: each rank's query heads get the key/value heads they read)."""
    for result in run_distributed(_four_ranks, 2, world_size=4, timeout_s=570):
        for case in FOUR_RANK_CASES:
            _check(result[case])


def _rewritten(model, batch):
    """The ops of ``model``'s dynamo graph as the sequence rewrite leaves it for rank 1 of 2 (``ops``: the graph's;
    ``body_ops``: those of the graphs nested in it, a checkpointed region's), and what it reported. Traced as in a
    DeepCompile forward (a checkpointed region's Python side effects traced, as the engine does)."""
    from deepspeed.compile.graph.sequence import shard_sequence
    from deepspeed.compile.integrations.ds_checkpointing import deepcompile_forward
    seen = {}

    def backend(gm, example_inputs):
        split = shard_sequence(gm, 0, 2, 1)
        seen["cut"], seen["whole"] = split.cut_inputs, split.whole_ops
        seen["ops"] = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        seen["body_ops"] = [n.target for name, body in gm.named_modules() if name for n in body.graph.nodes
                            if n.op in ("call_function", "call_method")]
        return gm.forward

    for tensor in batch.values():
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    torch._dynamo.reset()
    with pytest.raises(Exception), deepcompile_forward():  # not run: no sequence group exists in this process
        torch.compile(model, backend=backend)(**batch)
    torch._dynamo.reset()
    return seen


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_the_rewrite_splits_every_layer(checkpointing):
    """Where the collectives go in a traced Llama: an all-to-all before each attention input and after attention,
    one all-reduce for the loss, one all-gather for the logits the model returns; nothing gathered inside a layer.
    With Hugging Face's gradient checkpointing each layer is a body graph of its own, where its all-to-alls go."""
    from deepspeed.compile.runtime import ops
    seen = _rewritten(_model("llama", checkpointing=checkpointing), _batch(0, 0, 16))
    calls, bodies = seen["ops"], seen["body_ops"]
    assert len(seen["cut"]) == 1 and seen["whole"] == {}, seen
    assert (bodies if checkpointing else calls).count(ops.SEQ_ALL_TO_ALL) == 4 * 2, seen
    assert ops.SEQ_ALL_GATHER not in bodies and ops.SEQ_ALL_REDUCE not in bodies, bodies
    assert calls.count(ops.SEQ_ALL_REDUCE) == 1
    assert calls.count(ops.SEQ_ALL_GATHER) == 1  # the logits returned
    if not checkpointing:
        gather_at = calls.index(ops.SEQ_ALL_GATHER)
        assert gather_at > max(i for i, t in enumerate(calls) if t is ops.SEQ_ALL_TO_ALL)
    assert operator.floordiv in calls


class _Reads(torch.nn.Module):
    """Embeddings ``[batch, seq, dim]`` through one op, then summed over the features (a per-position reduction)."""

    def __init__(self, op):
        super().__init__()
        self.embed = torch.nn.Embedding(96, 8)
        self.op = op

    def forward(self, input_ids):
        return self.op(self.embed(input_ids)).sum(dim=-1)


# (op, whether it reads across the sequence, the name the report gives it)
_READS = {
    "softmax over the sequence": (lambda h: torch.softmax(h, dim=1), True, "softmax"),
    "softmax over the features": (lambda h: torch.softmax(h, dim=-1), False, None),
    "log_softmax method over the sequence": (lambda h: h.log_softmax(-2), True, "log_softmax"),
    "mean over the sequence, kept": (lambda h: h.mean(dim=1, keepdim=True) + h, True, "mean"),
    "sum over the features, kept": (lambda h: h.sum(dim=(-1, ), keepdim=True) * h, False, None),
    "cumsum over the sequence": (lambda h: h.cumsum(1), True, "cumsum"),
    "layer_norm over sequence and features": (lambda h: torch.nn.functional.layer_norm(h, h.shape[1:]), True,
                                              "layer_norm"),
    "layer_norm over the features": (lambda h: torch.nn.functional.layer_norm(h, h.shape[-1:]), False, None),
    "matmul contracting the sequence": (lambda h: h.transpose(1, 2).matmul(h), True, "matmul"),
}


@pytest.mark.parametrize("case", list(_READS))
def test_an_op_reading_across_the_sequence_runs_on_the_whole_sequence(case):
    """Each per-position op keeps a block only where it reads nothing across the sequence: one that normalizes,
    reduces or contracts over it gets its input gathered first (and is counted by name); one over the features stays
    split, and nothing is gathered before the graph's output."""
    from deepspeed.compile.runtime import ops
    op, across, name = _READS[case]
    seen = _rewritten(_Reads(op), {"input_ids": torch.randint(0, 96, (2, 16))})
    gathers = [i for i, t in enumerate(seen["ops"]) if t is ops.SEQ_ALL_GATHER]
    assert len(seen["cut"]) == 1, seen
    if across:
        # gathered before the op, not only the output (a full result meeting a block again is cut, not gathered)
        assert seen["whole"] == {name: 1} and gathers[0] < len(seen["ops"]) - 2, seen
    else:
        assert seen["whole"] == {} and gathers == [len(seen["ops"]) - 1], seen  # only the output, gathered last


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_autosp_stays_listed_only_where_the_engine_reaches_this_module_through_it(stage):
    """DeepSpeed's engine hands a config listing "autosp" to its AutoSP entry point (``init_sp``), which it calls at
    ZeRO-0 and 1 but refuses at 2 and 3: the config keeps the name at ZeRO-0 only, where this module's ZeRO
    pipelines are not asked; either way it asks for sequence parallelism. The config reads "autotp" beside it;
    ``engine.compile()`` refuses the two together (``test_sequence_stock.py``)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from models import ds_config
    config = ds_config(stage=stage, batch=2, optimizer="sgd", compile_section={"deepcompile": True,
                                                                               "passes": ["autosp", "autotp"]})
    config["sequence_parallel_size"] = 2
    compile_config = DeepSpeedConfig(config).compile_config
    assert compile_config.sequence_parallel and compile_config.tensor_parallel
    assert compile_config.passes == (["autosp"] if stage == 0 else []), compile_config.passes
