"""The `exaserve` command: argparse and printing only (main.py registers every subcommand).

Nothing in the package imports cli/: each command calls into app/ (the composition root) or a domain
package and prints what it gets back. `python -m exaserve_hpc.cli ARGS` is `exaserve ARGS`.
"""
