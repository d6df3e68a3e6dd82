"""`pip install .` (not editable) into a fresh environment: the wheel carries the batch script template,
the site configs and the modulefiles, so the installed `exaserve` can submit (dry run), check configs,
publish its modulefiles and launch a rank, with no source checkout anywhere on its path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from serve_harness import copy_sources, write_local_site

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv with exaserve-hpc built from a copy of the sources; its dependencies come from this test's
    environment through a plain path entry (not that environment's .pth files, so not its editable install)."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = copy_sources(tmp / "src", "*.conf", "data")
    venv = tmp / "venv"
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "exaserve_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    build = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                            "--no-build-isolation", "--no-index", "--ignore-installed", str(src)],
                           capture_output=True, text=True, timeout=600, cwd=tmp)
    assert build.returncode == 0, build.stdout + build.stderr
    return venv


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXASERVE_", "VIRTUAL_ENV", "PYTHON"))}
    return subprocess.run([str(venv / "bin" / "exaserve"), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def test_the_installed_package_is_the_one_that_runs(installed, tmp_path):
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import exaserve_hpc.resources as r; "
                            "print(r.PACKAGE); print(r.data_path('sbatch/exaserve.sbatch'))"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert all(str(installed) in w for w in where) and Path(where[1]).is_file()


def test_submit_dry_run_and_config_check_from_an_installed_wheel(installed, tmp_path):
    submit = run(installed, "submit", "--site", "small16-a100", "--dry-run", cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    assert "#SBATCH --nodes=16" in submit.stdout and "-m exaserve_hpc.launcher" in submit.stdout
    assert str(installed / "bin" / "python") in submit.stdout and str(ROOT) not in submit.stdout
    check = run(installed, "config", "check", "small16-a100", "local", "exa256-a100", cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert check.stdout.count(": ok (site") == 3


def test_modules_install_from_an_installed_wheel(installed, tmp_path):
    done = run(installed, "modules", "install", str(tmp_path / "mods"), "--site", "local", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    conf = (tmp_path / "mods" / "exaserve.conf").read_text()
    assert f"prefix={installed}" in conf and "site=" in conf and str(ROOT) not in conf
    assert list((tmp_path / "mods" / "exaserve").iterdir())
    # the shipped site named by --site is an editable copy beside the modulefiles, not a file in site-packages
    copies = tmp_path / "mods" / "site-configs"
    assert f"site={copies / 'local.yaml'}\n" in conf and f"site_dir={copies}\n" in conf, conf
    assert {p.name for p in copies.iterdir()} >= {"local.yaml", "small16-a100.yaml"}
    settings = dict(line.split("=", 1) for line in conf.splitlines() if "=" in line and not line.startswith("#"))
    assert all(Path(settings[k]).exists() for k in ("prefix", "site", "site_dir", "url") if k in settings), conf


def test_launch_from_an_installed_wheel(installed, tmp_path):
    site_file = write_local_site(tmp_path, weight_cache={"l2_path": str(tmp_path / "shm")})
    job_dir = tmp_path / "job"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXASERVE_", "SLURM_"))}
    rank = subprocess.Popen([str(installed / "bin" / "python"), "-m", "exaserve_hpc.launcher", "--site", str(site_file),
                             "--job-dir", str(job_dir), "--port", "0"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (job_dir / "serve.json").exists() and rank.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (job_dir / "serve.json").exists(), "rank 0 did not start"
        assert json.loads((job_dir / "controller.json").read_text())["endpoint"].startswith("tcp://")
        rank.send_signal(signal.SIGUSR1)
        assert rank.wait(timeout=60) == 0
    finally:
        if rank.poll() is None:
            rank.kill()
    assert "stopped" in rank.stdout.read()
