"""Old name of companion_jobs.py, kept while tests/slurm's e2e tests import it from here."""

from .companion_jobs import CompanionJobs, companion_name, render_companion  # noqa: F401
