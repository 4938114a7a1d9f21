# SPDX-License-Identifier: Apache-2.0
"""torch's AOTAutograd cache for the inductor backend: keying it on our passes, and what a loaded graph reports.

torch stores a dynamo graph's compiled forward and backward (inductor's code, our ops in it) under a key over the
dynamo graph, its inputs and torch's configs; a warm process then skips AOTAutograd's trace, our passes and
inductor's lowering. Three things make that safe for our graphs:
- The key covers what our partition and passes depend on. :class:`Partitioner` is inductor's custom partitioner
  (``torch._inductor.config.custom_partitioner_fn``, the mechanism torch keys custom partitions with): its
  ``uuid()`` hashes this package's source, the compile settings and what the passes read from the runtime and the
  graph inputs. Any change compiles afresh.
- A loaded graph needs nothing our compiler would have registered: each op carries what it needs
  (``ops.encode_plan``).
- What compiling tells about a graph (saved bytes, collective order, planned peak, kept bytes) is written to a small
  record beside torch's cache when the graph is compiled, and added to the engine's stats when it is loaded
  instead, so ``engine_report`` reads the same on a warm start.
"""
import dataclasses
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """Hash of this package's Python source: our passes and ops are part of every compiled graph."""
    files = tuple(sorted(str(p) for p in PACKAGE_ROOT.rglob("*.py")))
    return get_hash_for_files(files, extra=torch.__version__).hex()


def input_signature(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """Shapes, strides, dtypes and grad flags of a dynamo graph's inputs as dynamo traced them: a dynamic size by its
    symbol. The example inputs are the real tensors of the call that compiled the graph; a dynamic graph keyed on
    their sizes got another record on every rank, and in every process, whose first call had another length, while
    torch's key (symbolic too) served the graph to them all: loaded without its record."""
    traced = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
    if len(traced) != len(example_inputs):
        traced = [None] * len(example_inputs)
    parts = []
    for fake, real in zip(traced, example_inputs):
        value = fake if isinstance(fake, (torch.Tensor, torch.SymInt)) else real
        if isinstance(value, torch.Tensor):
            parts.append(f"{tuple(value.shape)}/{tuple(value.stride())}/{value.dtype}/{value.requires_grad}")
        else:
            parts.append(repr(value))
    return ";".join(parts)


def compile_key(**settings: Any) -> str:
    """One hex digest over this package's source and ``settings`` (plain values, ``repr``-stable)."""
    text = repr(sorted(settings.items()))
    return hashlib.sha256(f"{source_hash()}|{text}".encode()).hexdigest()


class Partitioner(CustomPartitionerFn):
    """A graph compiler's partition step, as inductor's custom partitioner: inductor runs its joint-graph passes,
    then calls this; the AOTAutograd and FX-graph caches key on :meth:`uuid`."""

    def __init__(self, partition, key: str):
        self.partition = partition
        self.key = key

    def __call__(self, gm, joint_inputs, **kwargs):
        return self.partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        return self.key

    # inductor deep-copies and pickles its config to hash it (``save_config_portable``): by key, not by the
    # compiler (and runtime, and process group) the partition is bound to
    def __deepcopy__(self, memo) -> "Partitioner":
        return self

    def __reduce__(self):
        return _by_key, (self.key,)


def _by_key(key: str) -> Partitioner:
    """A :class:`Partitioner` restored from its pickle: the key alone, never called."""
    return Partitioner(None, key)


def record_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return Path(cache_dir()) / "deepspeed_compile"


def runtime_state() -> str:
    """What torch's AOTAutograd key takes from the calling context besides the graph: grad mode, autocast per device,
    deterministic algorithms. One dynamo graph compiles differently under each (DeepSpeed's ``torch_autocast``
    enters autocast outside the compiled frame, so an fp32 and an autocast engine trace the same code)."""
    autocast = [(device, torch.get_autocast_dtype(device)) for device in torch._C._autocast_supported_devices()
                if torch.is_autocast_enabled(device)]
    return f"{torch.is_grad_enabled()}|{autocast}|{torch.are_deterministic_algorithms_enabled()}"


def record_key(key: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """The record of one dynamo graph: its code (our gathers inserted), its inputs, the calling context torch's key
    also covers, and the compile key. (torch's key also covers its own configs: a process that changes them loads
    a graph compiled under them with the record of the same graph compiled under others; both come from this code.)"""
    text = f"{key}|{gm.code}|{input_signature(gm, example_inputs)}|{runtime_state()}"
    return hashlib.sha256(text.encode()).hexdigest()


def _record_path(name: str, direction: str) -> Path:
    return record_dir() / f"{name}.{direction}.json"


def write_record(name: str, direction: str, part: Dict[str, Any]) -> None:
    """Store what compiling one direction of a graph found (atomically: every rank writes the same record)."""
    path = _record_path(name, direction)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(part))
        os.replace(tmp, path)
    except OSError as err:  # a read-only or full cache directory costs the report of a later warm start, no more
        log.warning("deepspeed-compile: could not write the compile record %s (%s)", path, err)


def read_record(name: str, direction: str) -> Optional[Dict[str, Any]]:
    path = _record_path(name, direction)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def as_plain(value: Any) -> Any:
    """A graph part's stats as JSON values (dataclasses as dicts, tuples as lists)."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {key: as_plain(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_plain(v) for v in value]
    return value
