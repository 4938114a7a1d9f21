# SPDX-License-Identifier: Apache-2.0
"""What the tests expect of the machine they run on, stated by the tests themselves (never read from the code under
test), and the one list of the skips a test may take for want of something on the machine.

Skips: a test that cannot run here for a fact about the machine calls :func:`unavailable_here` with a key of
``ALLOWED_OUTSIDE_CI``. Outside CI it skips, saying why; under ``CI=true`` it fails instead, so that CI never passes
a check it did not run. No test skips any other way (``test_docs.py`` checks that).

The transport: every test's ranks are processes of this machine, on CPU, with gloo, so ``compile.host_comm`` "auto"
must take shared memory wherever this machine offers it at all (x86-64, a ``/dev/shm`` directory). Under ``CI=true``
it must take it, whatever this module sees: ``test_host_comm.py``'s guard then fails, naming the reason the product
gave, and so does every test that expects it.
"""
import os
import platform
from typing import NoReturn, Optional

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


# the skips allowed outside CI: what the machine lacks, for each key of unavailable_here
ALLOWED_OUTSIDE_CI = {
    "native_op": "the native op cannot be built here",
    "cuda_check": "the native op's CUDA build cannot run here (no CUDA build of torch)",
    "shared_memory": "no shared memory between processes here",
    "tmpfs": "mounting a tmpfs (a container's small /dev/shm) is not allowed here",
    "malloc_trim": "the C library has no malloc_trim (not glibc) or there is no /proc/self/statm",
    "allocator_reuse": "the allocator never reused a freed address",
    "installed": "deepspeed-compile is not installed in this environment (pip install . installs it)",
    "checkout": "deepspeed.compile is not this checkout's",
}


def unavailable_here(what: str, detail: str = "", ci: Optional[bool] = None) -> NoReturn:
    """The test cannot run on this machine for want of ``what`` (a key of ``ALLOWED_OUTSIDE_CI``; ``detail`` says
    more): it fails under CI (``ci``: :func:`under_ci` unless given), and elsewhere skips, saying why."""
    import pytest
    reason = ALLOWED_OUTSIDE_CI[what] + (f": {detail}" if detail else "")
    if under_ci() if ci is None else ci:
        pytest.fail(f"CI must run this test, but {reason}")
    pytest.skip(reason)


def require_shared_memory() -> None:
    """A test that needs shared memory between its ranks: where this machine, as the test sees it, offers none, it
    fails under CI and skips elsewhere (:func:`unavailable_here`)."""
    missing = shared_memory_missing()
    if missing is not None:
        unavailable_here("shared_memory", missing)
