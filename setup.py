"""The package build: trnd and its compiled CPU kernels, in one step.

`pip install .`, `pip wheel .`, `python -m build` and `make venv`'s editable install all run build_kernels
(kernels/cpu/build.py's build_into): both ISA variants compiled, never -march=native, and put beside the
package, so an installed trnd loads them as a checkout does. The wheel is therefore a platform wheel
(py3-none-linux_x86_64: the libraries link torch's C++ libraries, not Python's), for the torch version
pyproject.toml pins; a build environment with another torch, or without a C++ compiler, fails with one line.

The `kernels/` folder installs as `trnd_kernels`: a top-level `kernels` would shadow Hugging Face's package of
that name (transformers imports it).
"""

import importlib.util
from pathlib import Path

from setuptools import Command, Distribution, find_packages, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build import build
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
DEST = "trnd_kernels/cpu/build"  # where kernels/cpu/__init__.py looks, inside the installed package


def _kernel_build():
    """kernels/cpu/build.py by path: the package is not importable while it is being built."""
    spec = importlib.util.spec_from_file_location("_trnd_kernel_build", ROOT / "kernels/cpu/build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class build_kernels(Command):
    description = "compile the CPU kernels (kernels/cpu/csrc) for every ISA variant"
    user_options = []

    def initialize_options(self):
        self.build_lib = self.build_temp = None
        self.editable_mode = False  # set by setuptools' editable_wheel: build in place (kernels/cpu/build)

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"), ("build_temp", "build_temp"))

    def run(self):
        import torch

        pinned = [r for r in self.distribution.install_requires if r.replace(" ", "").startswith("torch==")]
        want = pinned[0].split("==", 1)[1] if pinned else None
        if want and torch.__version__.split("+")[0] != want:
            raise SetupError(f"trnd pins torch=={want}, but this build environment has torch {torch.__version__}: "
                             f"the kernels would not load beside the pinned torch")
        kb = _kernel_build()
        dest = kb.BUILD if self.editable_mode else Path(self.build_lib) / DEST
        try:
            kb.build_into(dest, work=None if self.editable_mode else Path(self.build_temp) / "trnd_kernels")
        except kb.BuildError as e:
            raise SetupError(f"trnd: {e}") from None

    def get_outputs(self):
        return []

    def get_output_mapping(self):
        return {}

    def get_source_files(self):
        return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "kernels/cpu/csrc").iterdir())]


class BinaryDistribution(Distribution):
    """Holds compiled code (the kernels): install into platlib, and make bdist_wheel a platform wheel."""

    def has_ext_modules(self):
        return True


class platform_wheel(bdist_wheel):
    def get_tag(self):
        return "py3", "none", super().get_tag()[2]  # any Python 3: the kernels link torch, not libpython


build.sub_commands.append(("build_kernels", None))

setup(
    packages=find_packages(include=["trnd", "trnd.*"])
    + ["trnd_kernels" + p.removeprefix("kernels") for p in find_packages(include=["kernels", "kernels.*"])],
    package_dir={"trnd_kernels": "kernels"},
    cmdclass={"build_kernels": build_kernels, "bdist_wheel": platform_wheel},
    distclass=BinaryDistribution,
)
