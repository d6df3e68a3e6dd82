"""exaserve-hpc: serve large language models inside a Slurm allocation."""

__version__ = "0.1.0"
