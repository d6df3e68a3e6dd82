"""Old home of rank 0's requeue watch (now launcher/requeue_watch.py), kept while tests/slurm's e2e
tests import the checkpoint's file name from here."""

from ..controller_state import CHECKPOINT_FILE  # noqa: F401
from ..launcher.requeue_watch import REQUEST_FILE  # noqa: F401
