"""The operator install of docs/slurm.md, as written, runs the shipped `slurm-local` site on the local Slurm cluster
(issue 25 item 8): `python3 -m venv V && V/bin/pip install 'SRC[mpi]'` (a plain, non-editable install from
the package index, mpi4py built here), then `V/bin/exaserve submit --site slurm-local` by name; every rank
meets through PMIx (cluster.mpi: pmix) and the gateway answers the official openai client. The venv lives on
the cluster's shared filesystem, as a centre's shared prefix does. Marked slurm: under CI=true it must run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from serve_harness import copy_sources

from .fleet import Job, remove_shared_dir, shared_dir, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]
NODES = 2


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("EXASERVE_", "VIRTUAL_ENV", "PYTHON"))}


def test_the_readme_install_runs_slurm_local_by_name(slurm_cluster):
    directory = shared_dir("operator-install")
    job = None
    try:
        src = copy_sources(directory / "src", "*.so", "*.c")  # the sources a centre would have
        venv = directory / "exaserve"
        started = time.monotonic()
        made = subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", str(venv)],
                              capture_output=True, text=True, timeout=120, env=clean_env())
        assert made.returncode == 0, made.stderr
        install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"{src}[mpi]"], capture_output=True,
                                 text=True, timeout=900, env=clean_env(), cwd=directory)
        assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
        installed = time.monotonic() - started
        job_root = directory / "jobs"
        submitted = subprocess.run([str(venv / "bin" / "exaserve"), "submit", "--site", "slurm-local", "--nodes",
                                    str(NODES), "--time", "10m", "--job-root", str(job_root)],
                                   capture_output=True, text=True, timeout=120, env=clean_env(), cwd=directory)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        job = Job(int(submitted.stdout.split("submitted job ")[1].split(":")[0]), job_root)
        script = next(job_root.glob("*.sbatch")).read_text()
        assert "--mpi=pmix" in script and f"{venv}/bin/python" in script and str(ROOT) not in script, script
        status = wait_serving(job, agents=NODES, replicas=2, timeout=240)
        assert all(r.get("pid") for r in status["replicas"] if r["state"] == "serving")
        url = json.loads((job.job_dir / "serve.json").read_text())["url"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=60)
        reply = client.chat.completions.create(model="tiny-llama", max_tokens=8,
                                               messages=[{"role": "user", "content": "Hello"}])
        assert reply.usage.prompt_tokens > 0 and reply.choices[0].finish_reason in ("stop", "length"), reply
        ranks = json.loads((job.job_dir / "controller.json").read_text())["nodes"]
        print(f"\nREADME operator install: venv + pip install '.[mpi]' {installed:.0f}s; slurm-local job {job.job_id} "
              f"on {ranks} serving through PMIx ranks; chat answered ({reply.usage.completion_tokens} tokens)")
        assert len(ranks) == NODES
    finally:
        if job is not None:
            job.cancel_and_wait(60)
        remove_shared_dir(directory)
