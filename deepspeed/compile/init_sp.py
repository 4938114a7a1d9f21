# SPDX-License-Identifier: Apache-2.0
"""Entry point (stock ``engine.py`` imports it by name). AutoSP runs inside this module's ZeRO pipelines
(``graph/sequence.py``): ``CompileConfig`` takes ``"autosp"`` out of ``passes``, so the engine never calls this; a
direct call falls back to plain ``torch.compile``."""
from .engine_state import fall_back


def init_autosp(config):
    return fall_back("compile pass 'autosp'", "deepspeed-compile runs sequence parallelism inside DeepCompile's ZeRO "
                     "pipelines (compile.deepcompile true, ZeRO stage 1, 2 or 3)")
