"""Old module path of `exaserve launch` (now exaserve_hpc/launcher/), kept while tests/slurm/fleet.py
starts ranks as `python -m exaserve_hpc.slurm.launch_rank`."""

import sys

from ..launcher.rank import add_launch_arguments, cmd_launch, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
