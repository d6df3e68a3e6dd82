"""The usage ledger across a requeue on the local Slurm cluster: two quota groups' keys send requests through the
gateway of a job under `exaserve launch`; an operator's `requeue-requested` file makes rank 0 checkpoint and
`scontrol requeue` the job (the same job id comes back, in the same job directory, beside the same
JOB_ROOT/usage); the requeued run serves more requests; `exaserve usage` then reports, per group and per Slurm
account, exactly the tokens the clients counted from the responses' usage fields, and the requeued run restored
the groups' fair-share usage from the checkpoint. Marked slurm: under CI=true it must run."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import time

import openai
import pytest
import yaml

from exaserve_hpc.controller_state import CHECKPOINT_FILE, load_state
from exaserve_hpc.quota.keys import hash_key
from exaserve_hpc.batch.slurm.client import CliSlurmClient, SlurmError
from exaserve_hpc.batch.slurm.states import JobState

from .fleet import Job, echo_site, submit, wait_job, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]

KEYS = {"climate": "exa-climate-key-0123456789abcdef", "bio": "exa-bio-key-0123456789abcdef0"}
ACCOUNTS = {"climate": "clim001", "bio": "bio002"}




def send(url: str, counted: dict, rounds: int) -> None:
    """Each group: `rounds` plain completions and `rounds` streamed chats (usage in the last chunk); the usage
    fields are summed per group into counted[group] = [requests, prompt tokens, completion tokens]."""
    for group, key in KEYS.items():
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
        for i in range(rounds):
            usages = [client.completions.create(model="tiny-llama", prompt=f"{group} {i} " * (i + 1),
                                                max_tokens=4 + i).usage,
                      [c for c in client.chat.completions.create(
                          model="tiny-llama", messages=[{"role": "user", "content": f"{group} chat {i}"}],
                          max_tokens=6, stream=True, stream_options={"include_usage": True}) if c.usage][-1].usage]
            for usage in usages:
                assert usage.completion_tokens > 0, usage
                counted[group][0] += 1
                counted[group][1] += usage.prompt_tokens
                counted[group][2] += usage.completion_tokens


def usage_rows(ledger, by: str) -> dict[str, list[int]]:
    done = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "usage", "--dir", str(ledger), "--by", by,
                           "--csv"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {row[by]: [int(row["requests"]), int(row["prompt_tokens"]), int(row["completion_tokens"])]
            for row in csv.DictReader(io.StringIO(done.stdout))}


def test_usage_totals_equal_the_clients_counts_across_a_requeue(slurm_cluster, shared_tmp):
    site = echo_site(shared_tmp, replicas=2)
    data = yaml.safe_load(site.read_text())
    data["quota_groups"] = [{"name": g, "account": ACCOUNTS[g], "guaranteed_share": 0.4,
                             "api_key_hashes": [hash_key(k)]} for g, k in KEYS.items()]
    site.write_text(yaml.safe_dump(data))
    job = submit(site, shared_tmp / "jobs", nodes=1)
    client = CliSlurmClient()
    counted = {g: [0, 0, 0] for g in KEYS}
    t0 = time.time()
    try:
        wait_serving(job, agents=1, replicas=2, timeout=120)
        send(job.url(), counted, rounds=3)
        first_run = {g: (prompt + completion, requests) for g, (requests, prompt, completion) in counted.items()}

        # The operator's request: rank 0 checkpoints, then `scontrol requeue` ends this run.
        (job.job_dir / "requeue-requested").write_text("")
        wait_job(lambda: client.job(job.job_id).state is JobState.PENDING, 60, "the job back in the queue", job,
                 poll=0.3)
        saved = load_state(job.job_dir / CHECKPOINT_FILE)
        print(f"\nusage requeue: requested -> pending {time.time() - t0:.1f}s; checkpoint quota {saved.quota}")
        # Slurm holds a requeued job until its BeginTime (about two minutes); the operator lets it start now.
        subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True,
                       capture_output=True, timeout=30)
        after = wait_job(lambda: _restored(job), 120, "the requeued run serving with its checkpoint restored", job,
                         poll=0.3)
        print(f"usage requeue: requeued run serving {time.time() - t0:.1f}s")
        # The checkpoint's quota section is the ledger's figures for the first run, and the requeued run
        # restored it (its fair share starts from the first run's usage).
        assert saved.quota == first_run, (saved.quota, first_run)
        assert set(saved.quota_usage) == set(KEYS) and all(u > 0 for u in saved.quota_usage.values())
        assert after["restored"]["quota"] == {g: list(v) for g, v in first_run.items()}
        wait_serving(job, agents=1, replicas=2, timeout=60)
        send(job.url(), counted, rounds=2)
    finally:
        job.cancel()
        try:
            wait_job(lambda: client.job(job.job_id).state.terminal, 60, "the job to end", job, poll=0.3)
        except SlurmError:
            pass

    ledger = job.job_root / "usage"
    files = sorted(p.name for p in ledger.glob("usage-*.jsonl"))
    assert len(files) == 2, files  # one per run: the requeued one appended beside the first
    by_group = usage_rows(ledger, "group")
    assert by_group == counted, (by_group, counted)
    by_account = usage_rows(ledger, "account")
    assert by_account == {ACCOUNTS[g]: v for g, v in counted.items()}, by_account
    print(f"usage requeue: ledger {by_group} == clients' counts; {time.time() - t0:.1f}s in all")


def _restored(job: Job):
    try:
        status = job.status()
    except Exception:  # noqa: BLE001 - the requeued run's gateway may not answer yet
        return None
    return status if status.get("restored") else None
