"""`python -m exaserve_hpc.cli ARGS` is `exaserve ARGS`."""

import sys

from exaserve_hpc.cli.main import main

sys.exit(main())
