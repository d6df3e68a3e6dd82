"""Build hook: the batch script template, the site configs and the modulefiles travel inside the package
(exaserve_hpc/data/, read through exaserve_hpc/resources.py), so a non-editable install can submit
jobs and install the modulefiles. Everything else is in setup.cfg."""

import shutil
from pathlib import Path

from setuptools import setup
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


setup(cmdclass={"build_py": BuildWithData})
