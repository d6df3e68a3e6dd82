"""The controller-state checkpoint (HDF5): what is restored equals what was saved."""

from __future__ import annotations

import stat

import h5py
import pytest
from hypothesis import given, settings, strategies as st

from exaserve_hpc import controller_state
from exaserve_hpc.controller_state import (
    CheckpointFormatError, ControllerState, RolloutState, load_state, save_state, state_from_status,
)

names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=12)


def example() -> ControllerState:
    return ControllerState(
        job_id="1234", restart=2, saved_at=1795938000.25,
        placement={"tiny-llama/r0000": ("tiny-llama", "n1"), "tiny-llama/r0001": ("tiny-llama", ""),
                   "llama-70b/r0000": ("llama-70b", "gpu[001]")},
        affinity={2**63 + 5: ["tiny-llama/r0000"], 7: [], 11: ["tiny-llama/r0000", "tiny-llama/r0001"]},
        quota={"physics": (123456, 42), "bio": (0, 0)},
        rollout={"tiny-llama": RolloutState("v2", "canary", 0.1)},
        excluded_nodes=["n3"])


def test_restore_equals_save_and_the_file_is_private(tmp_path):
    state = example()
    path = save_state(tmp_path / "controller-state.h5", state)
    assert load_state(path) == state
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(tmp_path.glob(".*tmp"))


def test_overwrite_keeps_the_latest(tmp_path):
    path = tmp_path / "s.h5"
    save_state(path, example())
    later = example()
    later.restart, later.quota = 3, {"physics": (999, 1)}
    save_state(path, later)
    assert load_state(path) == later


def test_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(CheckpointFormatError, match="expected"):
        load_state(path)


@settings(max_examples=30, deadline=None)
@given(placement=st.dictionaries(names, st.tuples(names, st.one_of(st.just(""), names)), max_size=8),
       affinity=st.dictionaries(st.integers(0, 2**64 - 1), st.lists(names, max_size=3), max_size=8),
       quota=st.dictionaries(names, st.tuples(st.integers(0, 2**62), st.integers(0, 2**62)), max_size=4))
def test_any_state_round_trips(tmp_path_factory, placement, affinity, quota):
    state = ControllerState("j", 0, 1.5, placement=placement, affinity=affinity, quota=quota)
    path = tmp_path_factory.mktemp("ckpt") / "s.h5"
    assert load_state(save_state(path, state)) == state


def test_state_from_a_controller_status():
    status = {"replicas": [{"replica_id": "m/r0", "model": "m", "node": "n2"},
                           {"replica_id": "m/r1", "model": "m", "node": None}]}
    state = state_from_status(status, "77", 1, 10.0, ["n3"])
    assert state.placement == {"m/r0": ("m", "n2"), "m/r1": ("m", "")} and state.excluded_nodes == ["n3"]


def test_files_open_without_hdf5_locks_and_are_synced_before_the_rename(tmp_path, monkeypatch):
    """Lustre/NFS without flock mounts refuse HDF5's locks; a crash must leave the old file or the new one."""
    opened, order = [], []
    real_file, real_fsync, real_replace = h5py.File, controller_state.os.fsync, controller_state.os.replace

    def file(path, mode, **kwargs):
        opened.append(kwargs.get("locking"))
        return real_file(path, mode, **kwargs)

    monkeypatch.setattr(controller_state.h5py, "File", file)
    monkeypatch.setattr(controller_state.os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(controller_state.os, "replace", lambda a, b: (order.append("rename"), real_replace(a, b)))
    path = save_state(tmp_path / "s.h5", example())
    assert load_state(path) == example()
    assert opened == [False, False]
    assert order == ["fsync", "rename", "fsync"]  # the file's data, the rename, then the directory


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = save_state(tmp_path / "s.h5", example())

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(controller_state, "_write", broken)
    with pytest.raises(OSError, match="No space"):
        save_state(path, ControllerState("other", 9, 2.0))
    assert load_state(path) == example() and not list(tmp_path.glob(".*tmp"))
