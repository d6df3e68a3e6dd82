"""The job's directory on shared storage (``--job-dir``, the run directory under `exaserve serve`): every
file exaserve writes in it is mode 0600 and written atomically. Ranks meet through it when there is no MPI
(bootstrap.py), the run's CURVE keys live in it (transport.py), and the batch script's stop request lands in it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional


class BootstrapError(Exception):
    """Bootstrap cannot complete; the message says which rank waited for what, and where."""


class JobDir:
    """The job's directory on shared storage; every file we write in it is mode 0600."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def ensure(self) -> "JobDir":
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        for sub in ("inventory", "keys"):
            (self.path / sub).mkdir(exist_ok=True)
            os.chmod(self.path / sub, 0o700)
        return self

    def write_private(self, relative: str, data: bytes | str) -> Path:
        """Atomically (temp file + rename, same directory) and created 0600 from the start."""
        target = self.path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        return target

    def write_json(self, relative: str, obj: Any) -> Path:
        return self.write_private(relative, json.dumps(obj, indent=1, sort_keys=True))

    def read_json(self, relative: str) -> Optional[dict]:
        try:
            return json.loads((self.path / relative).read_text())
        except (OSError, ValueError):
            return None

    @property
    def controller_file(self) -> Path:
        return self.path / "controller.json"

    @property
    def stop_file(self) -> Path:
        """Created by the batch script when Slurm's --signal arrives (time limit near)."""
        return self.path / "stop-requested"


KV_SALT_FILE = "kv-salt"


def run_salt(jobdir: JobDir) -> bytes:
    """The run's secret block-hash salt (keys/kv-salt, 0600, made with the run's keys); b"" where the run
    has none (no CURVE keys): block hashes are then unsalted."""
    try:
        fd = os.open(jobdir.path / "keys" / KV_SALT_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise BootstrapError(f"the run's block-hash salt in {jobdir.path / 'keys'} cannot be read "
                             f"({exc.strerror}); the job directory must be shared by every node") from exc
    with os.fdopen(fd, "rb") as f:
        return f.read(64)
