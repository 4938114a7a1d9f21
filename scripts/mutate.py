# SPDX-License-Identifier: Apache-2.0
"""Does any test notice? Apply one exact text replacement to a source file, run pytest, put the file back.

    .venv/bin/python scripts/mutate.py deepspeed/compile/runtime/comm.py \
        "wait_for(work, self.timeout)" "wait_for(work, None)" -- test_pipeline.py -k timeout

Prints KILLED (some test failed, as it should) or SURVIVED (every test passed: what the change breaks is untested),
with pytest's last lines; NO TEST RAN, before any change, where the tests do not collect as they are (a ``-k`` that
matches nothing, an interpreter without torch), which would check nothing. Run it with the interpreter that has
the suite's packages (``.venv/bin/python``). The pytest arguments are relative to tests/unit/compile, where the
suite's conftest puts this checkout's ``deepspeed.compile`` first. ``OLD`` must occur exactly once in the file. The
file is restored whatever ends the run (a failure, Ctrl-C); do not commit while one runs. Exit status: 0 killed,
1 survived, 2 bad arguments or no test ran.
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TESTS = os.path.join(ROOT, "tests", "unit", "compile")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="source file, relative to the repository root")
    parser.add_argument("old", help="exact text to replace (must occur once)")
    parser.add_argument("new", help="replacement text")
    parser.add_argument("pytest_args", nargs="+", help="after --: test files and pytest options")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the test run is abandoned")
    args = parser.parse_args()
    path = os.path.join(ROOT, args.file)
    with open(path) as f:
        source = f.read()
    found = source.count(args.old)
    if found != 1:
        print(f"{args.file}: the text to replace occurs {found} times, must be once", file=sys.stderr)
        return 2
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "build", "torch_extensions")))
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # the tests must be collectable as they are (this interpreter has torch and the suite's imports): else a test
    # erroring on a missing module would read as a mutation killed
    collect = subprocess.run([*pytest, "--collect-only", *args.pytest_args], cwd=TESTS, env=env, capture_output=True,
                             text=True, timeout=args.timeout)
    if collect.returncode != 0:
        lines = [line for line in collect.stdout.splitlines() if line.strip()][-3:]
        print(f"NO TEST RAN: the tests do not collect unchanged (pytest exit {collect.returncode}, {sys.executable})")
        print("\n".join(lines))
        return 2
    start = time.perf_counter()
    try:
        with open(path, "w") as f:
            f.write(source.replace(args.old, args.new))
        run = subprocess.run([*pytest, "-x", *args.pytest_args], cwd=TESTS, env=env, capture_output=True, text=True,
                             timeout=args.timeout)
    finally:
        with open(path, "w") as f:
            f.write(source)
    lines = [line for line in run.stdout.splitlines() if line.strip()][-3:]
    verdict = "SURVIVED" if run.returncode == 0 else "KILLED"
    print(f"{verdict} in {time.perf_counter() - start:.0f} s (pytest exit {run.returncode})")
    print("\n".join(lines))
    return 1 if verdict == "SURVIVED" else 0


if __name__ == "__main__":
    sys.exit(main())
