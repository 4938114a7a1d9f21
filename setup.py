# SPDX-License-Identifier: Apache-2.0
"""deepspeed-compile: a drop-in ``deepspeed.compile`` (DeepCompile for ZeRO-3) for stock DeepSpeed.

The package source lives in ``deepspeed/compile`` and installs as ``deepspeed_compile`` next to DeepSpeed,
never over DeepSpeed's files. A ``.pth`` file installs a meta-path finder at interpreter start that answers
for the name ``deepspeed.compile`` with this package (see ``_deepspeed_compile_hook``). Nothing is compiled
at install time: the native op is JIT-built at first use, so the build needs no torch.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "deepspeed_compile-precedence.pth"
PTH_LINE = "import _deepspeed_compile_hook; _deepspeed_compile_hook.install()\n"
SRC = os.path.join("deepspeed", "compile")
CSRC = os.path.join("csrc", "compile")


def _subpackages(root: str, prefix: str) -> list:
    found = []
    for dirpath, _, files in os.walk(root):
        if "__init__.py" in files:
            rel = os.path.relpath(dirpath, root)
            found.append(prefix if rel == "." else prefix + "." + rel.replace(os.sep, "."))
    return sorted(found)


class BuildPyWithPth(build_py):
    """Also place the precedence ``.pth`` file at the top of the built tree (it lands in site-packages)."""

    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, PTH_NAME), "w") as f:
            f.write(PTH_LINE)
        # the native op's sources travel with the package: it is JIT-built at first use
        self.copy_tree(CSRC, os.path.join(self.build_lib, "deepspeed_compile", "csrc", "compile"))

    def get_outputs(self, include_bytecode=True):
        csrc = [os.path.join(self.build_lib, "deepspeed_compile", "csrc", "compile", name) for name in os.listdir(CSRC)]
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)] + csrc


with open(os.path.join("requirements", "requirements.txt")) as f:
    install_requires = [line.strip() for line in f if line.strip() and not line.startswith("#")]

setup(
    name="deepspeed-compile",
    version="0.1.0",
    description="DeepCompile for ZeRO-3 as a drop-in deepspeed.compile module, CPU-testable",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    package_dir={"deepspeed_compile": SRC, "": SRC},
    packages=_subpackages(SRC, "deepspeed_compile"),
    py_modules=["_deepspeed_compile_hook"],
    install_requires=install_requires,
    cmdclass={"build_py": BuildPyWithPth},
)
