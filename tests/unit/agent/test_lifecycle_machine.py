"""The replica lifecycle as a state machine: the allowed steps and their durations."""

from exaserve_hpc.agent.lifecycle import ORDER, Lifecycle, ReplicaState as S, can_move


def test_the_happy_path_is_one_step_at_a_time_with_durations():
    life = Lifecycle(entered_at=0.0)
    for t, state in enumerate(ORDER[1:], start=1):
        transition = life.move(state, now=t * 1.5)
        assert transition is not None and transition.seconds == 1.5
    assert [t.new for t in life.history] == ORDER[1:]
    assert life.state is S.STOPPED and life.seconds_in(S.LOADING) == 1.5


def test_steps_cannot_be_skipped_or_repeated_or_reversed():
    assert not can_move(S.RESERVING, S.WARMING)
    assert not can_move(S.LOADING, S.LOADING)
    assert not can_move(S.SERVING, S.LOADING)
    life = Lifecycle(0.0)
    assert life.move(S.SERVING, 1.0) is None and life.state is S.PENDING and not life.history


def test_any_live_state_can_fail_or_stop_and_terminal_states_are_final():
    for state in ORDER[:-1]:
        assert can_move(state, S.FAILED) and can_move(state, S.STOPPED)
    for end in (S.STOPPED, S.FAILED):
        assert not any(can_move(end, s) for s in S)
