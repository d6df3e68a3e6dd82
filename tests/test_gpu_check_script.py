"""benchmarks/gpu_check.sh on a machine without a GPU: it says so and exits 0 at once, touching nothing."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
BASH = shutil.which("bash") or "/bin/bash"


@pytest.mark.parametrize("nvidia_smi", [None, "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n"],
                         ids=["no-nvidia-smi", "nvidia-smi-fails"])
def test_without_a_gpu_the_check_is_not_run(tmp_path, nvidia_smi):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:  # the driver's tool is there but finds no GPU
        tool = bin_dir / "nvidia-smi"
        tool.write_text(nvidia_smi)
        tool.chmod(0o755)
    started = time.monotonic()
    done = subprocess.run([BASH, str(SCRIPT), str(tmp_path / "work")], capture_output=True, text=True, timeout=30,
                          env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "no GPU: not run\n"
    assert time.monotonic() - started < 10
    assert not (tmp_path / "work").exists()  # nothing installed, nothing made
