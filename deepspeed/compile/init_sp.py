# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name). Sequence parallelism runs inside this module's pipelines
(``graph/sequence.py``). At ZeRO stages 1-3 ``CompileConfig`` takes ``"autosp"`` out of ``passes``, so the engine
reaches them through its ZeRO entry points; at ZeRO-0 it keeps it, and the engine's ``get_autosp_backend`` calls
:func:`init_autosp`, which gives the engine the ZeRO-0 pipeline (``engine_state.activate_z0``)."""
from . import compat
from .engine_state import activate_z0, fall_back


def init_autosp(config):
    """The dynamo backend for the engine whose ds_config is ``config``. DeepSpeed passes the config only: the engine,
    the backend's name and the compile arguments are its ``get_deepspeed_compile_backend``'s (``compat.TARGETS``)."""
    request = _compile_request(config)
    if request is None:
        return fall_back("compile pass 'autosp'", "deepspeed-compile found no engine compiling with this config; "
                         "sequence parallelism runs where DeepSpeed's engine.compile() asks for it")
    engine, backend, compile_kwargs, schedule = request
    # DeepSpeed's AutoSP backend wants one graph and writes fullgraph into the dict of compile arguments (the default
    # argument of engine.compile() when none were given, shared by every later call): taken back out here
    compile_kwargs.pop("fullgraph", None)
    return activate_z0(engine, backend, config.compile_config, schedule, compile_kwargs)


def _compile_request(config):
    """(engine, backend, compile_kwargs, schedule) of the ``engine.compile()`` that asks for ``config``'s backend."""
    names = compat.caller_locals("get_deepspeed_compile_backend", 4)
    if names is None or getattr(names.get("self"), "_config", None) is not config:
        return None
    return names["self"], names.get("backend"), names.get("compile_kwargs"), names.get("schedule")
