# SPDX-License-Identifier: Apache-2.0
"""Checkpoints across engines: one saved by a DeepCompile engine loads into eager ZeRO-3 and the reverse.

2 gloo ranks, fp32, eager backend, AdamW (its moments are part of the checkpoint). Both engines start from the
same model and data, so the two checkpoints hold bitwise the same state (test_pipeline.py). After a cross-load the
parameters must be bitwise those saved, DeepCompile must still be active (and running its graphs) where it was
compiled, and 2 more steps must give bitwise the losses and parameters of the engine that saved the checkpoint,
which continued training: so the optimizer state was carried over too.
"""
from distributed import run_distributed
from deepspeed.compile.engine_state import runtime_of  # noqa: E402

TRAIN, MORE = 3, 2


def _cross_load(ckpt_dir):
    import torch
    from compare import full_params, unequal
    from models import ds_config
    from training import make_engine, train

    def engine_for(compiled):
        torch._dynamo.reset()
        engine = make_engine("gpt", ds_config(3, {"deepcompile": True} if compiled else None))
        if compiled:
            engine.compile(backend="eager")
        return engine

    saved, continued, saver = {}, {}, {}
    for tag, compiled in (("eager", False), ("deepcompile", True)):
        engine = engine_for(compiled)
        train(engine, "gpt", TRAIN)
        if compiled:  # what saves the checkpoint ran DeepCompile's graphs, not a fallback
            saver = {"active": engine.is_deepcompile_active(),
                     "gathers": runtime_of(engine, active_only=False).counters.gather.gathers}
        engine.save_checkpoint(ckpt_dir, tag=tag)
        saved[tag] = full_params(engine)
        continued[tag] = (train(engine, "gpt", MORE, first_step=TRAIN), full_params(engine))
        engine.destroy()
    out = {"saved_equal": not unequal(saved["eager"], saved["deepcompile"]), "saver": saver}
    for tag, compiled in (("deepcompile", False), ("eager", True)):  # load into the other kind of engine
        engine = engine_for(compiled)
        engine.load_checkpoint(ckpt_dir, tag=tag)
        loaded = {"restored_unequal": unequal(saved[tag], full_params(engine)),
                  "active": engine.is_deepcompile_active()}
        runtime = runtime_of(engine, active_only=False)
        losses = train(engine, "gpt", MORE, first_step=TRAIN)
        loaded.update(losses_equal=losses == continued[tag][0], losses=(losses, continued[tag][0]),
                      params_unequal=unequal(full_params(engine), continued[tag][1]),
                      gathers=runtime.counters.gather.gathers if runtime is not None else None)
        out[f"{tag} -> {'deepcompile' if compiled else 'eager'}"] = loaded
        engine.destroy()
    return out


def test_checkpoints_cross_load_between_deepcompile_and_eager_zero3(tmp_path):
    for out in run_distributed(_cross_load, str(tmp_path)):
        assert out["saver"]["active"] and out["saver"]["gathers"] > 0, out["saver"]
        assert out["saved_equal"]
        for direction in ("deepcompile -> eager", "eager -> deepcompile"):
            r = out[direction]
            assert r["restored_unequal"] == [], (direction, r["restored_unequal"])
            assert r["losses_equal"], (direction, r["losses"])
            assert r["params_unequal"] == [], (direction, r["params_unequal"])
        assert not out["deepcompile -> eager"]["active"]
        loaded = out["eager -> deepcompile"]
        assert loaded["active"], "DeepCompile is no longer active after load_checkpoint"
        assert loaded["gathers"] > 0, "training after load_checkpoint did not run the compiled graphs"
