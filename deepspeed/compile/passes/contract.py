# SPDX-License-Identifier: Apache-2.0
"""Pass contracts and schedule validation, the part of DeepSpeed's pass-schedule API the engine calls.

DeepSpeed's engine registers a fixed set of named passes at start-up and validates any
``engine.compile(schedule=...)`` against them. This module's pipeline is fixed (tag, partition, rewrite,
schedule) and configured through the ``"compile"`` section instead, so schedules are validated here for a
clear error and then refused by ``init_z3``.
"""
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

CAP_Z3_GATHER_RELEASE = "z3_gather_release"


@dataclass(frozen=True)
class PassContract:
    """What a registered pass needs before it and gives to passes after it."""
    provides: FrozenSet[str] = frozenset()
    requires: FrozenSet[str] = frozenset()
    conflicts_with: FrozenSet[str] = frozenset()


class PassContractError(ValueError):
    """A pass schedule that names an unknown pass or breaks a contract."""


class PassRegistry(Mapping):
    """Pass name -> pass callable, fixed when built, with each pass's contract (``contracts``). Read-only: a
    registry that engines could write to would be state they fight over."""

    def __init__(self, entries: Iterable[Tuple[str, Callable, PassContract]]):
        self._passes = {name: fn for name, fn, _ in entries}
        self.contracts: Dict[str, PassContract] = {name: contract for name, _, contract in entries}

    def __getitem__(self, name: str) -> Callable:
        return self._passes[name]

    def __iter__(self):
        return iter(self._passes)

    def __len__(self) -> int:
        return len(self._passes)


def not_in_pipeline(name: str) -> Callable:
    """A registered pass name whose stock implementation has no counterpart in this module's pipeline."""

    def refuse(*args, **kwargs):
        raise ValueError(f"compile pass {name!r} is a stock DeepCompile pass; deepspeed-compile runs its own "
                         "fixed pipeline configured in the ds_config 'compile' section, not pass schedules")

    refuse.__name__ = name
    return refuse


def validate_schedule(schedule: List[Tuple[int, List]], name_registry: Optional[Dict] = None,
                      contracts: Optional[Dict[str, PassContract]] = None) -> None:
    """Check ``[(step, [pass, ...]), ...]``: shape, known names, required capabilities and conflicts."""
    if not isinstance(schedule, (list, tuple)):
        raise PassContractError(f"schedule must be a list of (step, passes), got {type(schedule).__name__}")
    if contracts is None:
        contracts = getattr(name_registry, "contracts", {})
    for entry in schedule:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], int)):
            raise PassContractError(f"schedule entry {entry!r} is not (step: int, passes: list)")
        provided: set = set()
        names = []
        for ref in entry[1]:
            name = ref if isinstance(ref, str) else getattr(ref, "__name__", repr(ref))
            if isinstance(ref, str) and name_registry is not None and ref not in name_registry:
                raise PassContractError(f"schedule step {entry[0]}: unknown pass {ref!r}")
            contract = contracts.get(name, PassContract())
            missing = contract.requires - provided
            if missing:
                raise PassContractError(f"schedule step {entry[0]}: pass {name!r} needs {sorted(missing)} first")
            clash = contract.conflicts_with & set(names)
            if clash:
                raise PassContractError(f"schedule step {entry[0]}: pass {name!r} conflicts with {sorted(clash)}")
            provided |= contract.provides
            names.append(name)
