"""Files exaserve ships besides its code: the batch script template, the site configs, the modulefiles.

    data_path("sbatch/exaserve.sbatch")     # a source checkout's own file, else the installed copy

In a source checkout (and an editable install) these are the repository's sbatch/, site-configs/ and
modules/; a built wheel carries copies under exaserve_hpc/data/ (setup.py copies them at build time),
so `pip install .` into any environment can submit jobs and install modulefiles.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SHIPPED = ("sbatch", "site-configs", "modules")  # what setup.py copies into exaserve_hpc/data/


def data_path(relative: str) -> Path:
    checkout = PACKAGE.parent / relative
    if checkout.exists() and (PACKAGE.parent / "setup.cfg").exists():
        return checkout
    return PACKAGE / "data" / relative
