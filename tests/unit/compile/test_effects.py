# SPDX-License-Identifier: Apache-2.0
"""Every effect the package has on the whole process is installed in ``deepspeed/compile/effects.py`` and listed
there: no other module calls the mechanisms those effects use or assigns into torch's or DeepSpeed's modules, every
installer the list names exists and is called from where the list says, and every installer is listed. Every
attribute rebound on an object the package does not own goes through ``deepspeed/compile/adapters.py``, and each
adapter's target is checked at activation (``compat.TARGETS``). The checkers run on the real package and on
made-up sources that break each rule, so that they are known to fail."""
import ast
import inspect
import os
from typing import List

import pytest

from checkout import PACKAGE_DIR

# what changes torch or DeepSpeed for every caller in the process (dotted as the code spells it)
MECHANISMS = ("torch.library.custom_op", "torch.library.Library", "torch.library.register_fake",
              "torch.fx.node.has_side_effect", "eval_frame.set_code_exec_strategy",
              "torch.compiler.substitute_in_graph", "torch._dynamo.substitute_in_graph", "sys.meta_path")
# roots whose attributes no module but effects.py may assign (a module-level monkeypatch)
PROCESS_ROOTS = ("torch", "deepspeed", "convert_frame", "sys")
# the one listed exception: the name-precedence finder runs at interpreter start, before the package can be imported
ALLOWED = {"effects.py": None, "_deepspeed_compile_hook.py": {"sys.meta_path"}}


def dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def effects_in(source: str, filename: str = "<source>") -> List[str]:
    """The process-wide mechanisms ``source`` uses, one line each."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            hit = next((m for m in MECHANISMS if name == m or name.endswith("." + m)), None)
            if hit is not None:
                found.append(f"{filename}:{node.lineno}: {hit}")
            elif isinstance(node.ctx, ast.Store) and name.split(".")[0] in PROCESS_ROOTS:
                found.append(f"{filename}:{node.lineno}: assigns {name}")
    return found


def violations() -> List[str]:
    found = []
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, PACKAGE_DIR)
            allowed = ALLOWED.get(rel, set())
            for line in effects_in(open(path).read(), rel):
                if allowed is not None and not any(line.endswith(": " + m) for m in allowed):
                    found.append(line)
    return found


def test_every_process_wide_effect_is_installed_in_effects_only():
    assert violations() == []
    # and the scan sees them where they are
    effects_path = os.path.join(PACKAGE_DIR, "effects.py")
    assert len(effects_in(open(effects_path).read())) >= 6


@pytest.mark.parametrize("source", [
    "import torch\n@torch.library.custom_op('x::y', mutates_args=())\ndef f(t): return t\n",
    "import torch\nlib = torch.library.Library('x', 'FRAGMENT')\n",
    "import torch\ntorch._C._dynamo.eval_frame.set_code_exec_strategy(f.__code__, s)\n",
    "import torch\n@torch._dynamo.substitute_in_graph(g)\ndef f(): pass\n",
    "from torch._dynamo import convert_frame\nconvert_frame.exceeds_recompile_limit = f\n",
    "import torch\ntorch.nn.functional.linear = f\n",
    "import sys\nsys.meta_path.insert(0, f)\n",
])
def test_a_mechanism_outside_effects_is_reported(source):
    assert effects_in(source)


def test_the_list_names_every_installer_and_where_it_is_called():
    from deepspeed.compile import effects
    listed = set()
    for effect, (installers, caller) in effects.EFFECTS.items():
        names = [name.strip() for name in installers.split(",")]
        listed.update(names)
        caller_file = caller.split(" ")[0]
        if caller_file == "setup.py":  # the .pth file: setup.py writes the line that calls the hook's install
            source = open(os.path.join(PACKAGE_DIR, "..", "..", "setup.py")).read()
            assert "_deepspeed_compile_hook.install()" in source, effect
            continue
        source = open(os.path.join(PACKAGE_DIR, caller_file)).read()
        for name in names:
            assert callable(getattr(effects, name, None)), (effect, name)
            assert f"effects.{name}(" in source, f"{caller_file} does not call effects.{name} ({effect})"
    installers = {name for name, fn in vars(effects).items()
                  if inspect.isfunction(fn) and fn.__module__ == effects.__name__ and not name.startswith("_")}
    assert installers <= listed, installers - listed


# attributes the package rebinds on instances of torch's and DeepSpeed's classes (adapters.py)
REBOUND = ("forward", "compile", "_compiled_call_impl", "reduce_ipg_grads", "setup_buckets", "data")


def rebindings_in(source: str, filename: str = "<source>") -> List[str]:
    """Where ``source`` sets or deletes one of the rebound attributes on an object, one line each."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.attr in REBOUND:
            found.append(f"{filename}:{node.lineno}: {dotted(node) or node.attr}")
        elif (isinstance(node, ast.Call) and dotted(node.func) in ("setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in REBOUND):
            found.append(f"{filename}:{node.lineno}: {dotted(node.func)} {node.args[1].value}")
    return found


def test_every_rebinding_goes_through_an_adapter_whose_target_is_checked():
    from deepspeed.compile import adapters, compat
    found = []
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in sorted(files):
            path = os.path.join(folder, name)
            if name.endswith(".py") and os.path.relpath(path, PACKAGE_DIR) != "adapters.py":
                found += rebindings_in(open(path).read(), os.path.relpath(path, PACKAGE_DIR))
    assert found == []
    assert len(rebindings_in(open(os.path.join(PACKAGE_DIR, "adapters.py")).read())) >= 5  # the scan sees them
    for adapter in adapters.ADAPTERS:
        assert adapter.TARGET in compat.TARGETS, adapter.__name__
        assert "Written against" in " ".join(adapter.__doc__.split()), adapter.__name__
        for stage in adapter.TARGET[3]:
            assert compat.target_problems(stage, [adapter.TARGET]) == [], adapter.__name__


@pytest.mark.parametrize("source", [
    "module.forward = f\n", "del block.forward\n", "optimizer.reduce_ipg_grads = f\n", "param.data = x\n",
    "setattr(module, 'forward', f)\n", "m._compiled_call_impl = None\n",
])
def test_a_rebinding_outside_the_adapters_is_reported(source):
    assert rebindings_in(source)
