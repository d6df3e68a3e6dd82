"""The environment modules under a real Lmod: `module load exaserve` puts a working `exaserve` on PATH;
the modulefiles are versioned and describe themselves; `exaserve modules install` publishes an install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exaserve_hpc import __version__

pytestmark = pytest.mark.lmod

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def login_shell(script: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXASERVE_", "LMOD", "MODULE", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # no venv: the module must add it
    return subprocess.run(["bash", "-lc", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def lmod_present():
    probe = login_shell("type module")
    if probe.returncode != 0:
        pytest.skip(f"Lmod is not installed (apt-get install lmod): {probe.stderr.strip()}")


def fake_install(tmp_path: Path, modulefile: str) -> Path:
    """A copy of the install layout: <root>/modules/exaserve/<modulefile> and <root>/.venv/bin -> this venv."""
    root = tmp_path / "install"
    (root / "modules" / "exaserve").mkdir(parents=True)
    (root / ".venv").mkdir()
    (root / ".venv" / "bin").symlink_to(VENV_BIN)
    shutil.copy(ROOT / "modules" / "exaserve" / modulefile, root / "modules" / "exaserve" / modulefile)
    prereq = tmp_path / "prereqs" / "fakempi"
    prereq.mkdir(parents=True)
    (prereq / "4.1.lua").write_text('setenv("FAKEMPI_LOADED", "yes")\n')
    (root / "modules" / "exaserve.conf").write_text("site=/proj/site-configs/exa.yaml\nprereq=fakempi/4.1\n")
    return root


def test_lua_module_from_the_repository_puts_exaserve_on_path():
    result = login_shell("module use modules && module load exaserve && exaserve --version && "
                         "command -v exaserve && echo SITE=$EXASERVE_SITE")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exaserve-hpc" in result.stdout
    assert f"{ROOT}/.venv/bin/exaserve" in result.stdout or str(VENV_BIN) in result.stdout
    assert f"SITE={ROOT}/site-configs/local.yaml" in result.stdout


@pytest.mark.parametrize("modulefile", [f"{__version__}.lua", __version__])
def test_module_loads_the_site_prerequisites_and_sets_the_site(tmp_path, modulefile):
    root = fake_install(tmp_path, modulefile)
    result = login_shell(f"module use {tmp_path}/prereqs && module use {root}/modules && module load exaserve && "
                         "exaserve --version && echo SITE=$EXASERVE_SITE MPI=$FAKEMPI_LOADED && module -t list 2>&1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exaserve-hpc" in result.stdout
    assert "SITE=/proj/site-configs/exa.yaml MPI=yes" in result.stdout
    assert "fakempi/4.1" in result.stdout


def test_module_without_an_install_fails_with_a_clear_message(tmp_path):
    (tmp_path / "modules" / "exaserve").mkdir(parents=True)
    shutil.copy(ROOT / "modules" / "exaserve" / f"{__version__}.lua", tmp_path / "modules" / "exaserve")
    result = login_shell(f"module use {tmp_path}/modules && module load exaserve && echo LOADED")
    assert "LOADED" not in result.stdout
    assert "no install at" in result.stderr


@pytest.mark.parametrize("modulefile", [f"{__version__}.lua", __version__])
def test_modulefiles_are_versioned_and_describe_themselves(tmp_path, modulefile):
    root = fake_install(tmp_path, modulefile)
    result = login_shell(f"module use {root}/modules && module -t avail exaserve 2>&1; module whatis exaserve 2>&1; "
                         "module help exaserve 2>&1")
    assert f"exaserve/{__version__}" in result.stdout
    for line in (f"Version: {__version__}", "Category: ", "URL: ", "exaserve submit --site SITE", "EXASERVE_SITE"):
        assert line in result.stdout, result.stdout
    text = (ROOT / "modules" / "exaserve" / modulefile).read_text()
    assert "conflict" in text and "prereq" in text


def test_modules_install_publishes_this_install_with_the_sites_prerequisites(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text((ROOT / "site-configs" / "local.yaml").read_text().replace(
        "  gpus_per_node: 0\n", "  gpus_per_node: 0\n  modules: [fakempi/4.1]\n"))
    prereq = tmp_path / "prereqs" / "fakempi"
    prereq.mkdir(parents=True)
    (prereq / "4.1.lua").write_text('setenv("FAKEMPI_LOADED", "yes")\n')
    done = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "modules", "install", str(tmp_path / "mods"),
                           "--site", str(site), "--prefix", str(VENV_BIN.parent)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    conf = (tmp_path / "mods" / "exaserve.conf").read_text()
    assert f"site={site}" in conf and "prereq=fakempi/4.1" in conf
    result = login_shell(f"module use {tmp_path}/prereqs && module use {tmp_path}/mods && module load exaserve && "
                         "exaserve config check $EXASERVE_SITE && echo MPI=$FAKEMPI_LOADED")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok (site local" in result.stdout and "MPI=yes" in result.stdout
