"""sbatch rendering: a golden file pins the script; the schema rejects unknown keys; the CLI renders from a site."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exaserve_hpc.config.schema import load_site
from exaserve_hpc.batch.slurm.sbatch import SbatchOptionError, options_from_site, render_sbatch, slurm_duration

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "exaserve-gpu.sbatch"
GOLDEN_SMALL16 = Path(__file__).parent / "golden" / "small16-a100.sbatch"

GOLDEN_OPTIONS = dict(site_file="/proj/ai/exaserve/site.yaml", job_root="/scratch/ai/exaserve/jobs",
                      job_name="exaserve-exa", nodes=16, time_limit=24 * 3600, partition="gpu", account="ai-platform",
                      qos="serving", modules=["cuda/12.4", "openmpi/4.1"], launcher="exaserve launch",
                      gpus_per_node=8, exclusive=True, mem=512 * 2**30, cpus_per_task=64)


def regenerate_or_compare(path: Path, text: str) -> None:
    if os.environ.get("EXASERVE_REGEN_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"rendering changed; if intended, rerun with EXASERVE_REGEN_GOLDEN=1 ({path})"


def test_rendered_script_matches_the_golden_file():
    regenerate_or_compare(GOLDEN, render_sbatch(**GOLDEN_OPTIONS))


def test_submit_dry_run_for_small16_asks_for_gpus_whole_nodes_memory_and_cpus():
    """`exaserve submit --dry-run --site small16-a100`, pinned by a golden file (paths made stable)."""
    command = [sys.executable, "-m", "exaserve_hpc.cli", "submit", "--site", "small16-a100", "--dry-run",
               "--job-root", "/scratch/ai/exaserve/jobs", "--option", "launcher=exaserve launch"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = result.stdout.replace(str(ROOT), "/opt/exaserve")
    for line in ("#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --mem=0",
                 "#SBATCH --cpus-per-task=128", "#SBATCH --signal=USR1@120"):
        assert line + "\n" in text, line
    assert "--mpi=pmix --cpu-bind=none --cpus-per-task=128 --gpus-per-node=8" in text
    regenerate_or_compare(GOLDEN_SMALL16, text)


def test_resource_directives_follow_the_options():
    text = render_sbatch(site_file="/s.yaml", job_root="/j", gpus_per_node=4, mem=3 * 2**30 + 1,
                         exclusive=False, mpi="none")
    assert "#SBATCH --gpus-per-node=4" in text and "#SBATCH --mem=3073M" in text
    assert "#SBATCH --exclusive" not in text and "#SBATCH --cpus-per-task" not in text
    # Without cpus_per_task the node's one task gets every CPU the job holds there.
    assert '--mpi=none --cpu-bind=none --cpus-per-task="${SLURM_CPUS_ON_NODE}" --gpus-per-node=4' in text
    bare = render_sbatch(site_file="/s.yaml", job_root="/j", mem=None)
    assert "--gpus-per-node=" not in bare and "#SBATCH --mem" not in bare and "#SBATCH --exclusive" in bare
    for bad, match in ((dict(mem="lots"), "mem must be"), (dict(mpi="openmpi"), "mpi must be one of pmix"),
                       (dict(cpus_per_task=0), "cpus_per_task must be"), (dict(gpus_per_node=-1), "gpus_per_node"),
                       (dict(exclusive="yes"), "exclusive must be")):
        with pytest.raises(SbatchOptionError, match=match):
            render_sbatch(site_file="/s.yaml", job_root="/j", **bad)


def test_stop_signals_reach_the_ranks_and_the_batch_shell_never_stops_srun():
    """The stop signal goes to the step's tasks (no "B:"); the shell's traps never TERM or KILL srun
    (srun answers TERM by SIGKILLing every task); a USR1 sent to the shell alone is passed to srun."""
    text = render_sbatch(**GOLDEN_OPTIONS)
    assert "#SBATCH --signal=USR1@120" in text and "B:" not in text
    assert "kill -TERM" not in text and "kill -KILL" not in text and "kill -9" not in text
    assert 'kill -USR1 "$srun_pid"' in text and "trap forward_stop USR1" in text and "trap note_term TERM" in text


def test_the_script_carries_the_fault_tolerance_options():
    text = render_sbatch(**GOLDEN_OPTIONS)
    for line in ("#SBATCH --no-kill", "#SBATCH --requeue", "#SBATCH --signal=USR1@120", "#SBATCH --nodes=16",
                 "#SBATCH --time=1-00:00:00", "#SBATCH --account=ai-platform", "#SBATCH --qos=serving",
                 "#SBATCH --partition=gpu", "module load cuda/12.4 openmpi/4.1"):
        assert line in text
    assert "srun --no-kill --kill-on-bad-exit=0" in text and "--ntasks-per-node=1" in text
    result = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr


def test_unknown_keys_are_rejected_with_the_valid_ones_listed():
    with pytest.raises(SbatchOptionError) as info:
        render_sbatch(**GOLDEN_OPTIONS, gpus_per_task=1)
    message = str(info.value)
    assert "gpus_per_task" in message and "partition (default None)" in message and "nodes (default 1)" in message
    with pytest.raises(SbatchOptionError, match="site_file is required"):
        render_sbatch(job_root="/x")
    with pytest.raises(SbatchOptionError, match="nodes must be"):
        render_sbatch(site_file="/s", job_root="/x", nodes=0)


def test_optional_directives_are_left_out_when_unset():
    text = render_sbatch(site_file="/s.yaml", job_root="/j")
    assert "--account" not in text and "--qos" not in text and "--time" not in text and "module load" not in text


@pytest.mark.parametrize("seconds, expected", [(60, "1:00"), (1800, "30:00"), (3600, "1:00:00"),
                                               (5400, "1:30:00"), (90000, "1-01:00:00"), (61, "2:00")])
def test_slurm_duration(seconds, expected):
    assert slurm_duration(seconds) == expected


def test_options_from_the_site_config(tmp_path):
    data = yaml.safe_load((ROOT / "site-configs" / "slurm-local.yaml").read_text())
    data["cluster"].update(account="proj1", qos="normal", modules=["openmpi"])
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    options = options_from_site(load_site(path), path, nodes=2)
    assert options["nodes"] == 2 and options["account"] == "proj1" and options["modules"] == ["openmpi"]
    assert options["time_limit"] == 1800 and options["partition"] == "debug"
    # slurm-local declares its GRES GPUs and asks for whole nodes like a GPU site
    assert options["gpus_per_node"] == 4 and options["exclusive"] is True and options["mem"] == "all"
    assert options["mpi"] == "pmix"


def test_submit_dry_run_and_bad_option_exit_codes(tmp_path):
    command = [sys.executable, "-m", "exaserve_hpc.cli", "submit", "--site", "slurm-local", "--dry-run",
               "--job-root", str(tmp_path), "--time", "10m", "--nodes", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=3" in result.stdout and "#SBATCH --time=10:00" in result.stdout
    assert f"--output={tmp_path}/exaserve-%j.out" in result.stdout
    bad = subprocess.run(command + ["--option", "colour=red"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "colour" in bad.stderr and "valid:" in bad.stderr
    options = ["--option", "exclusive=false", "--option", "mem=2GiB", "--option", "cpus_per_task=2"]
    tuned = subprocess.run(command + options, capture_output=True, text=True, timeout=60)
    assert tuned.returncode == 0, tuned.stderr
    assert "#SBATCH --exclusive" not in tuned.stdout and "#SBATCH --mem=2G" in tuned.stdout
    assert "#SBATCH --cpus-per-task=2" in tuned.stdout
    bad = subprocess.run(command + ["--option", "exclusive=maybe"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "exclusive takes true or false" in bad.stderr
