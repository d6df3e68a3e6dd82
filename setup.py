"""Build hook: the batch script template, the site configs and the modulefiles travel inside the package
(exaserve_hpc/data/, read through exaserve_hpc/resources.py), so a non-editable install can submit
jobs and install the modulefiles. Everything else is in setup.cfg.

The router's prefix index and route are also compiled (router/_*.pyx; Cython, from pyproject's build
requirements) when a C compiler and the Python headers are there. Optional: a failed compile is a
warning, the install goes on, and the package falls back to the pure-Python index and route with a
log line (router/prefix_index.py)."""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = ("sbatch", "site-configs", "modules")  # = exaserve_hpc.resources.SHIPPED


class BuildWithData(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "exaserve_hpc" / "data"
        for name in SHIPPED:
            if (ROOT / name).is_dir():  # a site's own exaserve.conf is written by `exaserve modules install`
                shutil.copytree(ROOT / name, target / name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.conf", "__pycache__", "*.pyc"))


class OptionalBuildExt(build_ext):
    """Extensions that may fail to compile (no gcc, no Python headers) without failing the install.

    Extension(optional=True) is not enough: an editable install copies every extension's output into
    the source tree afterwards, and some setuptools versions let the compiler's exit status through.
    """

    failed: set = set()

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any failure: the pure-Python code serves instead
            self.failed.add(ext.name)
            print(f"WARNING: {ext.name} not compiled ({exc}); exaserve uses its pure-Python version")

    def copy_extensions_to_source(self):
        kept = self.extensions
        self.extensions = [e for e in kept if e.name not in self.failed]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = kept

    def get_outputs(self):
        return [path for path in super().get_outputs() if Path(path).exists() or not self.failed]


def compiled_extensions() -> list:
    try:
        from Cython.Build import cythonize
    except ImportError:  # a build without pyproject's requirements (setup.py run by hand): pure Python
        print("Cython not installed: the router's prefix index stays pure Python")
        return []
    return cythonize([Extension(f"exaserve_hpc.router.{name}", [f"exaserve_hpc/router/{name}.pyx"],
                                extra_compile_args=["-O3"], optional=True)
                      for name in ("_prefix_index", "_affinity_route")],
                     compiler_directives={"language_level": "3"}, quiet=True)


setup(cmdclass={"build_py": BuildWithData, "build_ext": OptionalBuildExt}, ext_modules=compiled_extensions())
