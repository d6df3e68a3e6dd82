"""A Slurm site whose ranks meet through MPI (cluster.mpi pmix or pmi2) cannot start where mpi4py is missing:
`exaserve submit` refuses it before Slurm queues the job, `config check` warns, naming the [mpi] extra."""

from __future__ import annotations

import importlib.util

import pytest

from exaserve_hpc.cli import main as cli
from exaserve_hpc.config.schema import load_site, resolve_site
from exaserve_hpc.cli import submit


@pytest.fixture
def without_mpi4py(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))


def test_submit_refuses_a_pmix_site_without_mpi4py_naming_the_extra(without_mpi4py, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(submit, "slurm_client", lambda: pytest.fail("the job reached Slurm"))
    code = cli.main(["submit", "--site", "small16-a100", "--job-root", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "cluster.mpi: pmix needs mpi4py" in err and "exaserve-hpc[mpi]" in err and "cluster.mpi: none" in err
    assert not list(tmp_path.glob("*.sbatch"))


def test_config_check_warns_and_local_or_mpi_none_sites_are_fine(without_mpi4py):
    assert "needs mpi4py" in (load_site(resolve_site("small16-a100")).mpi_problem() or "")
    assert load_site(resolve_site("local")).mpi_problem() is None  # no partition: `exaserve serve` uses no MPI
    site = load_site(resolve_site("slurm-local"))
    assert site.model_copy(update={"cluster": site.cluster.model_copy(update={"mpi": "none"})}).mpi_problem() is None


def test_with_mpi4py_installed_nothing_is_said():
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed here")
    assert load_site(resolve_site("small16-a100")).mpi_problem() is None
