"""`python -m exaserve_hpc.launcher ARGS` is `exaserve launch ARGS` (what the batch script runs; the shipped
sbatch template names this module, so it stays where job scripts already look for it)."""

import sys

from exaserve_hpc.cli.main import main

sys.exit(main(["launch", *sys.argv[1:]]))
