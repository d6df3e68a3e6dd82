"""Old name of controller_state.py (the controller's HDF5 state), kept while tests/slurm's e2e tests
import it; new code imports exaserve_hpc.controller_state."""

from .controller_state import *  # noqa: F401,F403
from .controller_state import CHECKPOINT_FILE, CheckpointFormatError, ControllerState, RolloutState  # noqa: F401
