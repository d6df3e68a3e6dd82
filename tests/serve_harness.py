"""Running a real `exaserve serve` from a test: start it, wait for its URL, stop it, check nothing is left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a centre's copy of the sources holds: what `pip install SRC` builds from (no .venv, no build outputs)
SOURCES = ("exaserve_hpc", "sbatch", "site-configs", "modules", "setup.py", "setup.cfg", "pyproject.toml",
           "MANIFEST.in", "README.md")


def copy_sources(dest: Path, *ignore: str) -> Path:
    """Copy SOURCES from this checkout into `dest` (made), leaving out __pycache__ and the `ignore` patterns."""
    import shutil
    dest.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", *ignore))
        else:
            shutil.copy(ROOT / name, dest / name)
    return dest


def write_local_site(tmp: Path, scheduler: dict | None = None, model: dict | None = None,
                     router: dict | None = None, **sections: dict) -> Path:
    """site-configs/local.yaml with its checkpoints and run directory under `tmp`, and these sections
    updated; written to tmp/site.yaml, whose path is returned."""
    import yaml
    site = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    site["weight_cache"]["l3_path"] = str(tmp / "models")
    site["run_dir"] = str(tmp / "run")
    site["scheduler"].update(scheduler or {})
    site.setdefault("router", {}).update(router or {})
    site["models"][0].update(model or {})
    for name, values in sections.items():  # e.g. weight_cache={"l2_path": ...}, requeue={...}
        site.setdefault(name, {}).update(values)
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def start_serve(site_file: Path, env: dict | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    process = subprocess.Popen([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(site_file),
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **(env or {})})
    lines: list[str] = []
    url_box: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            match = re.search(r"serving .* at (http://\S+)/v1", line)
            if match:
                url_box.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 90
    while not url_box:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("exaserve serve did not become ready:\n" + "".join(lines))
        time.sleep(0.1)
    return process, url_box[0], lines


def stop_serve(process: subprocess.Popen, lines: list[str], timeout: float = 45) -> None:
    """SIGTERM, as a scheduler or Ctrl-C would; exaserve must drain and exit 0 in time."""
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=timeout) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
