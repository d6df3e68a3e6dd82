"""The environment modules under a real Lmod: `module load exaserve` puts a working `exaserve` on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def fake_install(tmp_path: Path, modulefile: str, target: str) -> Path:
    """A copy of the install layout: <root>/modules/<target> and <root>/.venv/bin -> this venv."""
    root = tmp_path / "install"
    (root / "modules").mkdir(parents=True)
    (root / ".venv").mkdir()
    (root / ".venv" / "bin").symlink_to(VENV_BIN)
    shutil.copy(ROOT / "modules" / modulefile, root / "modules" / target)
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


@pytest.mark.parametrize("modulefile, target", [("exaserve.lua", "exaserve.lua"), ("exaserve.tcl", "exaserve")])
def test_module_loads_the_site_prerequisites_and_sets_the_site(tmp_path, modulefile, target):
    root = fake_install(tmp_path, modulefile, target)
    result = login_shell(f"module use {tmp_path}/prereqs && module use {root}/modules && module load exaserve && "
                         "exaserve --version && echo SITE=$EXASERVE_SITE MPI=$FAKEMPI_LOADED && module -t list 2>&1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exaserve-hpc" in result.stdout
    assert "SITE=/proj/site-configs/exa.yaml MPI=yes" in result.stdout
    assert "fakempi/4.1" in result.stdout


def test_module_without_an_install_fails_with_a_clear_message(tmp_path):
    (tmp_path / "modules").mkdir()
    shutil.copy(ROOT / "modules" / "exaserve.lua", tmp_path / "modules" / "exaserve.lua")
    result = login_shell(f"module use {tmp_path}/modules && module load exaserve && echo LOADED")
    assert "LOADED" not in result.stdout
    assert "no install at" in result.stderr
