# SPDX-License-Identifier: Apache-2.0
"""The releases the package is written for: checked at ``engine.compile()`` before anything changes, declared to pip
as ranges (installing keeps a supported torch and DeepSpeed already there), and tested on exact releases."""
import os
import re

import pytest

from checkout import REPO_ROOT


def test_the_running_releases_pass_the_check():
    from deepspeed.compile import compat
    assert compat.target_problems(3) == [] and compat.target_problems(2) == [] and compat.target_problems(0) == []
    compat.check(3)
    compat.check(1)
    compat.check(0)


def test_another_release_is_refused_naming_both_versions_before_the_engine_is_touched(monkeypatch):
    """``activate_z3`` is handed no engine at all: the refusal comes first, so nothing was changed."""
    import deepspeed
    from deepspeed.compile import compat, engine_state
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    with pytest.raises(RuntimeError) as raised:
        engine_state.activate_z3(None, "eager", None)
    message = str(raised.value)
    assert "deepspeed 0.20.1 (supported: >=0.19.8,<0.20)" in message and "torch >=2.13,<2.16" in message, message
    assert compat.ALLOW_ENV in message
    with pytest.raises(RuntimeError):
        engine_state.activate_z12(None, "eager", None)


def test_the_override_turns_the_refusal_into_a_warning(monkeypatch, caplog):
    import torch
    from deepspeed.compile import compat
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    with caplog.at_level("WARNING", logger=compat.log.name):
        compat.check(3)
    assert "torch 2.16.0 (supported: >=2.13,<2.16)" in caplog.text


def test_local_builds_and_prereleases_of_a_supported_release_count_as_it():
    from deepspeed.compile import compat
    assert compat.version_problems({"torch": "2.13.0+cpu", "deepspeed": "0.19.8"}) == []
    assert compat.version_problems({"torch": "2.13.1a0+git0123", "deepspeed": "0.19.9"}) == []
    assert compat.version_problems({"torch": "2.12.1", "deepspeed": "0.19.7"}) == [
        "torch 2.12.1 (supported: >=2.13,<2.16)", "deepspeed 0.19.7 (supported: >=0.19.8,<0.20)"]


def test_a_rebound_attribute_gone_or_changed_is_named():
    from deepspeed.compile import compat
    targets = [("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer",
                {"reduce_ipg_grads": ("comm_dtype", "a_parameter_it_never_had"), "a_method_it_never_had": None}, (2, )),
               ("torch.nn", "NoSuchClass", {"forward": None}, (2, 3)),
               ("torch.nn", "NoSuchClassAtZeRO3", {"forward": None}, (3, ))]  # another stage's: not looked at
    problems = compat.target_problems(2, targets)
    assert problems[0] == ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.reduce_ipg_grads has no "
                           "parameter a_parameter_it_never_had"), problems
    assert problems[1] == ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.a_method_it_never_had is "
                           "missing"), problems
    assert problems[2].startswith("torch.nn.NoSuchClass ("), problems
    assert len(problems) == 3


def test_state_a_deepspeed_object_sets_in_its_init_is_checked_on_the_object():
    """DeepSpeed 0.19.7's ZeRO-1/2 optimizer had no ``_use_compact_grad_partition_buffer``: a ZeRO-1/2 step failed
    with an AttributeError (``scripts/try_deepspeed.sh 0.19.7``). Such attributes are named at activation."""
    from types import SimpleNamespace
    from deepspeed.compile import compat
    with pytest.raises(RuntimeError, match=r"lacks what the package rebinds or calls: DeepSpeedZeroOptimizer\.ipg_"
                                           r"buckets is missing; DeepSpeedZeroOptimizer\.zenflow is missing$"):
        compat.require_attributes(SimpleNamespace(bit16_groups=[]), ("bit16_groups", "ipg_buckets", "zenflow"),
                                  "DeepSpeedZeroOptimizer")


def _requirements(name: str) -> dict:
    with open(os.path.join(REPO_ROOT, "requirements", name)) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return dict(re.match(r"([A-Za-z0-9_.-]+)(.*)", line).groups() for line in lines if line and
                not line.startswith("-"))


def test_pip_gets_the_checked_ranges_and_the_tests_run_on_releases_inside_them():
    from packaging.specifiers import SpecifierSet
    from deepspeed.compile import compat
    required, pinned = _requirements("requirements.txt"), _requirements("constraints.txt")
    for name, supported in compat.SUPPORTED.items():
        assert required[name] == supported, (name, required[name])  # a range, never an exact pin
        assert pinned[name].startswith("==") and pinned[name][2:] in SpecifierSet(supported), (name, pinned[name])


def test_every_private_torch_name_the_package_imports_is_checked_at_activation():
    """A torch release that moves or changes one of torch's private names the package uses is refused at
    ``engine.compile()`` naming it (``compat.TORCH_INTERNALS``), not met as an ImportError deep inside a compile."""
    import ast
    from deepspeed.compile import compat
    listed = {(module, name) for module, owner, names, _ in compat.TARGETS if owner is None for name in names}
    # a module imported by name (``from torch._dynamo import convert_frame``) is covered by its own entry
    listed |= {tuple(module.rsplit(".", 1)) for module, owner, _, _ in compat.TARGETS if owner is None}
    imported = set()
    package = os.path.join(REPO_ROOT, "deepspeed", "compile")
    for folder, _, files in os.walk(package):
        for file in files:
            if file.endswith(".py"):
                with open(os.path.join(folder, file)) as f:
                    tree = ast.parse(f.read())
                imported |= {(node.module, alias.name) for node in ast.walk(tree)
                             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._")
                             for alias in node.names}
    assert len(imported) >= 15, imported  # the walk found the package's imports
    assert imported - listed == set(), sorted(imported - listed)
