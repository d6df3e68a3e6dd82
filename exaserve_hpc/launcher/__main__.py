"""`python -m exaserve_hpc.launcher ARGS` is `exaserve launch ARGS` (what the batch script runs)."""

import sys

from exaserve_hpc.launcher.rank import main

sys.exit(main())
