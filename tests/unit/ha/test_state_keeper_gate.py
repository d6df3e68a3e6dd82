"""The HDF5 checkpoint's HA gate (no sockets): a controller that is not acting as the leader writes no
checkpoint, periodic, on a signal (control_plane's checkpoint_once calls save) or at a stop; without HA
(no gate) and while acting it writes as before."""

from __future__ import annotations

from exaserve_hpc.app.state_keeper import StateKeeper


class Fleet:
    """The controller as the keeper sees it (unit-test stand-in): a status and, under HA, the lease gate."""

    def __init__(self, acting=None):
        self.restored = None
        if acting is not None:
            self.acting = acting

    def status(self) -> dict:
        return {"replicas": [{"replica_id": "r0", "model": "m", "node": "n1"}]}


def recording_keeper(fleet, tmp_path, **kwargs):
    written = []
    keeper = StateKeeper(fleet, tmp_path / "state.h5", "77", 0, sleep=lambda _: None,
                         save=lambda path, state: written.append((path, state)) or path, **kwargs)
    return keeper, written


def test_without_ha_and_while_acting_the_checkpoint_is_written(tmp_path):
    keeper, written = recording_keeper(Fleet(), tmp_path)
    assert keeper.save() and len(written) == 1
    keeper, written = recording_keeper(Fleet(acting=lambda: True), tmp_path)
    assert keeper.save() and len(written) == 1


def test_a_deposed_leader_writes_no_checkpoint(tmp_path):
    keeper, written = recording_keeper(Fleet(acting=lambda: False), tmp_path)
    assert keeper.save() is False
    assert written == [] and keeper.saved_at is None


def test_a_lease_lapsing_between_retries_stops_the_retries(tmp_path):
    leading = {"now": True}
    attempts = []

    def failing_save(path, state):
        attempts.append(state)
        leading["now"] = False  # deposed while the write failed (a slow shared filesystem)
        raise OSError("disk full")

    keeper = StateKeeper(Fleet(acting=lambda: leading["now"]), tmp_path / "state.h5", "77", 0, attempts=3,
                         sleep=lambda _: None, save=failing_save)
    assert keeper.save() is False
    assert len(attempts) == 1, "no retry once the controller stopped acting"
