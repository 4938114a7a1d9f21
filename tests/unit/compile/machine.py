# SPDX-License-Identifier: Apache-2.0
"""What the tests expect of the machine they run on, stated by the tests themselves (never read from the code under
test).

The transport: every test's ranks are processes of this machine, on CPU, with gloo, so ``compile.host_comm`` "auto"
must take shared memory wherever this machine offers it at all (x86-64, a ``/dev/shm`` directory). Under ``CI=true``
it must take it, whatever this module sees: ``test_host_comm.py``'s guard then fails, naming the reason the product
gave, and so does every test that expects it.
"""
import os
import platform
from typing import Optional

SHM_DIR = "/dev/shm"  # compile.host_comm_dir's default


def under_ci() -> bool:
    """``.ci/run`` sets ``CI=true`` unless the caller set ``CI`` itself."""
    return os.environ.get("CI") == "true"


def shared_memory_missing() -> Optional[str]:
    """Why this machine, as the test sees it, offers the runtime no shared memory between its processes, or None."""
    arch = platform.machine().lower()
    if arch not in ("x86_64", "amd64"):
        return f"this machine is {arch}, not x86-64"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} is not a directory here"
    return None


def expected_transport(host_comm: str) -> str:
    """The transport (``"shm"`` or ``"gloo"``) a compiled engine of a test must report for ``compile.host_comm``
    ``host_comm``: ``"gloo"`` and ``"shm"`` say it; ``"auto"`` is shared memory under CI, and elsewhere wherever this
    machine offers it (:func:`shared_memory_missing`)."""
    if host_comm in ("gloo", "shm"):
        return host_comm
    assert host_comm == "auto", host_comm
    return "shm" if under_ci() or shared_memory_missing() is None else "gloo"


def require_shared_memory() -> None:
    """A test that needs shared memory between its ranks skips where this machine offers none, outside CI only (under
    CI the test runs, and fails where the product cannot set it up, naming why)."""
    import pytest
    missing = shared_memory_missing()
    if missing is not None and not under_ci():
        pytest.skip(f"no shared memory between processes here: {missing}")
