"""prefetch_plan: what a node should load into L2 next, from demand history and its L2 contents."""

from exaserve_hpc.cache.prefetch import forecast, prefetch_plan
from exaserve_hpc.protocol import L2EntryStatus, L2Status

GB = 1 << 30


def l2(capacity, *entries):
    return L2Status(capacity=capacity, used=sum(e.nbytes for e in entries), entries=list(entries))


def test_forecast_follows_a_rising_trend_and_never_goes_negative():
    assert forecast([]) == 0.0
    assert forecast([1, 2, 3, 4]) == 5.0  # trend beats the lagging EWMA
    assert forecast([10, 0, 0, 0]) > 0  # EWMA remembers
    assert forecast([9, 5, 1]) >= 0.0


def test_the_most_wanted_model_not_in_l2_is_fetched_first():
    plan = prefetch_plan({"a": [5, 5], "b": [1, 8], "c": [9, 9]}, l2(100 * GB, L2EntryStatus("c", 10 * GB, "ready")),
                         {"a": 10 * GB, "b": 10 * GB, "c": 10 * GB}, max_fills=2)
    assert [p.model for p in plan] == ["b", "a"] and all(p.evicts == () for p in plan)


def test_prefetch_evicts_only_what_is_less_wanted_and_never_pinned():
    state = l2(30 * GB, L2EntryStatus("cold", 10 * GB, "ready", idle_s=100),
               L2EntryStatus("hot", 10 * GB, "ready", idle_s=50),
               L2EntryStatus("pinned", 10 * GB, "ready", pins=1, idle_s=999))
    sizes = {"new": 10 * GB, "cold": 10 * GB, "hot": 10 * GB, "pinned": 10 * GB}
    (action,) = prefetch_plan({"new": [4, 4], "cold": [0, 0], "hot": [9, 9]}, state, sizes)
    assert action.model == "new" and action.evicts == ("cold",)
    # the LRU victim is wanted more than the candidate: do not prefetch
    assert prefetch_plan({"new": [1, 1], "cold": [3, 3]}, state, sizes) == []


def test_one_fill_at_a_time_per_node_and_unknown_or_idle_models_skipped():
    busy = l2(100 * GB, L2EntryStatus("x", GB, "filling"))
    assert prefetch_plan({"a": [5]}, busy, {"a": GB}) == []
    assert prefetch_plan({"a": [0, 0], "nosize": [9]}, l2(100 * GB), {"a": GB}) == []
    assert prefetch_plan({"big": [9]}, l2(GB), {"big": 2 * GB}) == []
