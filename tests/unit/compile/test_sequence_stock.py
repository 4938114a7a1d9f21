# SPDX-License-Identifier: Apache-2.0
"""Sequence parallelism as a user of stock DeepSpeed's AutoSP meets it: a script written for stock's AutoSP (its tag
keys, ``prepare_autosp_inputs``, ``engine.compile(compile_kwargs={"dynamic": True})``) trains as one rank on the whole
sequence; what the rewrite cannot make exact is refused at ``engine.compile()`` (``composition.py``); stock's names,
values and signatures are kept; :class:`deepspeed.compile.data.SequenceGroupSampler` feeds each sequence group one
batch.

One launch of 2 ranks (one sequence group), apart from ``test_sequence.py``'s, whose launch fills its time limit; it
also runs that file's comparison at ZeRO-2.
The reference of the stock script is the same model in plain torch on each rank, trained on the whole sequences
(SGD of the same rate): ``STOCK_SCRIPT_TOL`` below.
"""
import pytest
import torch

from distributed import run_distributed
from test_sequence import LENGTHS, _against_eager, _batch, _check, _model

# relative, fp32: the bound asked of a stock script; the split model reorders fp32 sums (test_sequence.py's 1e-6 for
# losses, compare.FP32_REORDER_TOL for parameters), well inside it
STOCK_SCRIPT_TOL = 1e-4


def _sample(index: int) -> dict:
    """One sequence of 16 tokens as a stock AutoSP script feeds it, with its position ids; every third is padded on
    the left (mask 0, labels -100 there)."""
    g = torch.Generator().manual_seed(500 + index)
    ids = torch.randint(0, 96, (16, ), generator=g)
    mask = torch.ones_like(ids)
    if index % 3 == 2:
        mask[:3] = 0
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "position_ids": torch.arange(16),
            "attention_mask": mask}


def _stock_script(steps: int):
    """A training script written for stock's AutoSP, as its users write it: the tag keys from
    ``deepspeed.compile.constants``, ``prepare_autosp_inputs``, ``engine.compile(compile_kwargs={"dynamic": True})``,
    ZeRO-1, ``sequence_parallel_size`` 2, fed through DeepSpeed's loader with :class:`SequenceGroupSampler`. Beside
    it, on each rank, the same model in plain torch (SGD of the same rate) trains on the whole sequences."""
    import copy
    import deepspeed
    from compare import compiled_record, full_params
    from deepspeed.compile import constants
    from deepspeed.compile.data import SequenceGroupSampler
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs
    from deepspeed.compile.report import engine_report
    from models import OPTIMIZERS, ds_config
    torch._dynamo.reset()
    model = _model("llama")
    whole = copy.deepcopy(model)  # one rank training the whole sequence
    optimizer = torch.optim.SGD(whole.parameters(), lr=OPTIMIZERS["sgd"]["params"]["lr"])
    config = ds_config(stage=1, batch=2, optimizer="sgd", compile_section={"deepcompile": True, "passes": ["autosp"]})
    config["sequence_parallel_size"] = 2
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    # the backend a stock script leaves to the accelerator is inductor on CPU; the eager one keeps this launch short
    # (test_sequence.py trains the split model under inductor)
    engine.compile(backend="eager", compile_kwargs={"dynamic": True})
    data = [_sample(i) for i in range(2 * steps)]
    # no worker processes: the ranks are daemonic processes here
    loader = iter(engine.deepspeed_io(data, data_sampler=SequenceGroupSampler(data, 2, seed=7),
                                      num_local_io_workers=0))
    losses, whole_losses, tags = [], [], None
    for _ in range(steps):
        batch = next(loader)
        ids, labels, positions, mask = prepare_autosp_inputs(batch["input_ids"], batch["labels"],
                                                             batch["position_ids"], batch["attention_mask"])
        tags = tags or (ids.tag[0], labels.tag[0], positions.tag[0])
        loss = engine(input_ids=ids, labels=labels, position_ids=positions, attention_mask=mask).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        whole_loss = whole(**{key: value.clone() for key, value in batch.items()}).loss
        whole_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        whole_losses.append(whole_loss.item())
    out = {"losses": losses, "whole_losses": whole_losses, "record": compiled_record(engine),
           "report": engine_report(engine), "params": full_params(engine),
           "whole_params": {name: p.detach().clone() for name, p in whole.named_parameters()},
           "tags": tags, "keys": (constants.AUTOSP_INPUT_ID_KEY, constants.AUTOSP_LABEL_ID_KEY,
                                  constants.AUTOSP_POSITION_ID_KEY)}
    engine.destroy()
    return out


class _AloneMpu:
    """Megatron's model-parallel interface for 2-way model parallelism over the world: each rank alone in its
    data-parallel group, so ZeRO averages over 1 of the 2 ranks."""

    def __init__(self):
        import torch.distributed as dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.alone = [dist.new_group([r]) for r in range(self.world)][self.rank]  # every rank creates each group

    def get_data_parallel_group(self):
        return self.alone

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        import torch.distributed as dist
        return dist.group.WORLD

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_model_parallel_world_size(self):
        return self.world

    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_model_parallel_rank(self):
        return self.rank

    get_tensor_model_parallel_rank = get_model_parallel_rank


def _refused(stage: int, passes, config_extra=None, **initialize):
    """The ValueError ``engine.compile()`` raises for a sequence-parallel engine (None if it compiled), and whether
    the engine was left uncompiled."""
    import deepspeed
    from deepspeed.utils import groups
    from models import ds_config
    torch._dynamo.reset()
    model = _model("llama", 1)
    config = ds_config(stage=stage, batch=2, optimizer="sgd", compile_section={"deepcompile": True, "passes": passes})
    config.update({"sequence_parallel_size": 2, **(config_extra or {})})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                      **initialize)
    try:
        engine.compile(backend="eager")
        error = None
    except ValueError as err:
        error = str(err)
    out = {"error": error, "untouched": not engine.is_compiled and not engine.is_deepcompile_active()}
    engine.destroy()
    groups.mesh_device, groups.mpu = None, None  # what DeepSpeed's engine set for the process: the next engine's own
    return out


def _refusals():
    """engine.compile() of each sequence-parallel configuration the rewrite cannot make exact. Last in the launch: an
    AutoTP engine's tensor-parallel groups stay for the process."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    out = {"autotp pass": _refused(1, ["autosp", "autotp"]),
           "data_parallel_size": _refused(1, ["autosp"], {"data_parallel_size": 1}),
           "data_parallel_size zero-0": _refused(0, ["autosp"], {"data_parallel_size": 1}),
           "mpu": _refused(3, ["autosp"], mpu=_AloneMpu())}
    parallel_state_sp.initialize_sequence_parallel(2)
    out["ulysses mpu"] = _refused(2, ["autosp"], mpu=parallel_state_sp)
    parallel_state_sp._release_sequence_parallel_groups()
    out["autotp_size"] = _refused(1, ["autosp"], {"tensor_parallel": {"autotp_size": 2}})
    return out


def _launch():
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"stock script": _stock_script(3),
           # ZeRO-2, the stage test_sequence.py's launch has no room for: one layer, against eager ZeRO-2
           "zero-2": _against_eager("llama", 2, 2, len(LENGTHS), layers=1)}
    out["refusals"] = _refusals()  # last: the engines it builds leave DeepSpeed's groups set for the process
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_launch, timeout_s=480)


def test_sequence_parallel_at_zero2_trains_as_the_unsharded_model(two_ranks):
    """``test_sequence.py``'s check at ZeRO-2 (``compare.FP32_REORDER_TOL``): gradients after the first backward,
    parameters and losses against eager ZeRO-2 fed each group's batch."""
    for result in two_ranks:
        _check(result["zero-2"])


def test_a_stock_autosp_script_trains_as_one_rank_on_the_whole_sequence(two_ranks):
    """The stock AutoSP script (``_stock_script``): on every rank, every step's loss within 1e-4 relative of one rank
    training the whole sequences in plain torch, and the parameters after three steps too; DeepCompile ran (its
    graphs reduced every gradient) and the sequence group's collectives were placed; the tags are stock's."""
    from compare import assert_ran_compiled, max_rel_diff, rel_diffs
    for result in two_ranks:
        r = result["stock script"]
        assert r["tags"] == r["keys"] == ("input_id", "label_id", "position_id"), (r["tags"], r["keys"])
        assert_ran_compiled(r["record"])
        report = r["report"]
        assert report["sequence_parallel_size"] == 2 and report["sequence_collectives"] > 0, report
        assert max_rel_diff(r["losses"], r["whole_losses"]) <= STOCK_SCRIPT_TOL, (r["losses"], r["whole_losses"])
        params = rel_diffs(r["params"], r["whole_params"])
        assert max(params.values()) <= STOCK_SCRIPT_TOL, sorted(params.items(), key=lambda kv: -kv[1])[:3]


REFUSALS = {  # case -> words its error must hold: the setting, and what to do instead
    "autotp pass": ("'autosp' and 'autotp'", "not combined", "Use one"),
    "autotp_size": ("tensor_parallel.autotp_size=2", "not combined", "Use one"),
    "data_parallel_size": ("data_parallel_size", "Remove data_parallel_size", "keeping sequence_parallel_size"),
    "data_parallel_size zero-0": ("data_parallel_size", "Remove data_parallel_size", "keeping sequence_parallel_size"),
    "ulysses mpu": ("get_sequence_parallel_world_size", "Remove the mpu", "Ulysses"),
    "mpu": ("zero_optimization.stage=3", "over 1 of the 2 ranks", "remove the mpu"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_sequence_parallel_refuses_what_it_cannot_make_exact(two_ranks, case):
    """engine.compile() refuses, before it changes anything (the engine stays uncompiled), sequence parallelism with
    tensor parallelism (both passes, or AutoTP's layers), with DeepSpeed's own sequence parallelism (a data x
    sequence mesh from data_parallel_size, at ZeRO-1 and ZeRO-0; Ulysses' mpu, at ZeRO-2), and with ZeRO averaging
    over fewer ranks than the world (a Megatron-style mpu, at ZeRO-3): a ValueError naming the setting and what to do
    instead."""
    for result in two_ranks:
        r = result["refusals"][case]
        assert r["error"] is not None and r["untouched"], r
        assert "'autosp'" in r["error"] and all(words in r["error"] for words in REFUSALS[case]), r["error"]


class _Renamed(torch.nn.Module):
    """A one-layer Llama whose token ids arrive under a name the rewrite does not look for (``tokens``): only a tag
    names them."""

    def __init__(self):
        super().__init__()
        self.inner = _model("llama", layers=1)

    def forward(self, tokens, targets, positions, mask):
        return self.inner(input_ids=tokens, labels=targets, position_ids=positions, attention_mask=mask).loss


@pytest.mark.parametrize("tagging", ["prepare_autosp_inputs", "bare keys", "none"])
def test_the_rewrite_finds_token_ids_tagged_the_stock_way(tagging):
    """Token ids tagged as stock's AutoSP scripts tag them, through ``prepare_autosp_inputs`` (``(key, seq_dim)``,
    stock's values from ``deepspeed.compile.constants``) or by setting ``tensor.tag`` to the bare key, are cut where
    they enter and every layer is split; untagged under an unknown name, nothing is."""
    from deepspeed.compile import constants
    from deepspeed.compile.graph.sequence import shard_sequence
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs
    from deepspeed.compile.runtime import ops
    assert (constants.AUTOSP_INPUT_ID_KEY, constants.AUTOSP_LABEL_ID_KEY, constants.AUTOSP_POSITION_ID_KEY) == (
        "input_id", "label_id", "position_id")  # stock's values: scripts may write them out
    seen = {}

    def backend(gm, example_inputs):
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        seen["cut"] = [(placeholders[index], dim) for index, dim in shard_sequence(gm, 0, 2, 1).cut_inputs]
        seen["ops"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward

    batch = _batch(0, 0, 16)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    positions = torch.arange(16).unsqueeze(0).expand(2, 16).contiguous()
    if tagging == "prepare_autosp_inputs":
        out = prepare_autosp_inputs(ids, labels, positions, mask, seq_dim=1)
        assert out == (ids, labels, positions, mask)
        assert (ids.tag, labels.tag, positions.tag) == (("input_id", 1), ("label_id", 1), ("position_id", 1))
    else:
        for tensor in (ids, labels, positions, mask):
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        if tagging == "bare keys":
            ids.tag, labels.tag = constants.AUTOSP_INPUT_ID_KEY, constants.AUTOSP_LABEL_ID_KEY
            positions.tag = constants.AUTOSP_POSITION_ID_KEY
    torch._dynamo.reset()
    compiled = torch.compile(_Renamed(), backend=backend)
    if tagging == "none":
        compiled(ids, labels, positions, mask)  # nothing rewritten: runs whole, with no sequence group
    else:
        with pytest.raises(Exception):  # the graph is not run: no sequence group exists in this process
            compiled(ids, labels, positions, mask)
    torch._dynamo.reset()
    if tagging == "none":
        assert seen["cut"] == [] and ops.SEQ_ALL_TO_ALL not in seen["ops"], seen["cut"]
        return
    assert seen["cut"] == [("l_tokens_", 1)], seen["cut"]  # the token ids, along dimension 1
    assert seen["ops"].count(ops.SEQ_ALL_TO_ALL) == 4, seen["ops"].count(ops.SEQ_ALL_TO_ALL)  # q, k, v, out


def test_prepare_autosp_inputs_refuses_as_stock_does():
    from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs
    ids = torch.zeros(2, 8, dtype=torch.long)
    for args, kwargs, words in (((None, ids), {}, "input_id is required"), ((ids, None), {}, "label_id is required"),
                                ((ids, ids), {"seq_dim": 2}, "seq_dim=2"), ((ids, ids), {"seq_dim": -1}, "seq_dim=-1"),
                                ((ids, ids, torch.zeros(8)), {}, "position_id")):
        with pytest.raises(ValueError, match=words):
            prepare_autosp_inputs(*args, **kwargs)


def test_sequence_group_sampler_feeds_each_group_one_shard():
    """Ranks 0-1 and 2-3 of 4 (sequence_parallel_size 2): the ranks of a group draw the same indices, the groups
    disjoint shards covering the data, as DistributedSampler over 2 replicas would give them."""
    from torch.utils.data import DistributedSampler
    from deepspeed.compile.data import SequenceGroupSampler, sequence_data_parallel
    data = list(range(10))
    drawn = [list(SequenceGroupSampler(data, 2, seed=3, rank=rank, world_size=4)) for rank in range(4)]
    assert drawn[0] == drawn[1] and drawn[2] == drawn[3] and not set(drawn[0]) & set(drawn[2]), drawn
    assert sorted(drawn[0] + drawn[2]) == data
    assert drawn[2] == list(DistributedSampler(data, num_replicas=2, rank=1, seed=3))
    assert sequence_data_parallel(4, rank=5, world_size=8) == (2, 1)
    with pytest.raises(ValueError, match="sequence_parallel_size=3"):
        sequence_data_parallel(3, rank=0, world_size=4)


def _stock_source(relative: str):
    """A module of stock DeepSpeed's own ``deepspeed.compile`` (installed beside this one), parsed."""
    import ast
    import os
    import deepspeed
    with open(os.path.join(os.path.dirname(deepspeed.__file__), "compile", relative)) as f:
        return ast.parse(f.read())


def test_stock_autosp_user_api_has_stocks_names_values_and_signatures():
    """What a script written for stock's AutoSP imports, read from stock DeepSpeed's source: every constant of its
    ``constants`` module with its value, and the parameters of ``prepare_autosp_inputs`` and the ``init_*`` entry
    points, in order, with their defaults."""
    import ast
    import importlib
    import inspect
    from deepspeed.compile import constants
    stock_constants = {node.targets[0].id: ast.literal_eval(node.value) for node in _stock_source("constants.py").body
                       if isinstance(node, ast.Assign)}
    assert stock_constants and all(getattr(constants, name) == value for name, value in stock_constants.items()), \
        stock_constants
    for module, function in (("passes/sp_compile.py", "prepare_autosp_inputs"), ("init_sp.py", "init_autosp"),
                             ("init_tp.py", "init_autotp"), ("init_z1_and_2.py", "init_z1_and_2"),
                             ("init_z3.py", "init_z3")):
        stock = next(node for node in _stock_source(module).body
                     if isinstance(node, ast.FunctionDef) and node.name == function)
        defaults = [None] * (len(stock.args.args) - len(stock.args.defaults)) + [
            ast.literal_eval(d) for d in stock.args.defaults]
        expected = [(a.arg, d) for a, d in zip(stock.args.args, defaults)]
        ours = importlib.import_module("deepspeed.compile." + module[:-3].replace("/", "."))
        params = inspect.signature(getattr(ours, function)).parameters.values()
        got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]
        assert got == expected, (function, got, expected)
