"""What to load into a node's L2 next, from demand history: a pure policy for the controller.

Call protocol (every control-loop tick, per live node):

    plan = prefetch_plan(demand_history, heartbeat.l2, model_bytes)
    for action in plan:
        send(agent_id, Prefetch(model=action.model, model_dir=site.model_dir(action.model)))

``demand_history[model]`` is requests per interval, oldest first (the
controller's autoscaler counts them anyway). ``l2`` is the node's last
L2Status from its heartbeat. The forecast is the larger of an EWMA and a
linear extrapolation of the last few intervals, so rising models are
fetched before they peak. A model is prefetched only if it fits in free
room, or if every entry the agent's LRU would evict to make room (pinned
and filling entries never are) has a lower forecast than it: a prefetch
never pushes out something more wanted. At most ``max_fills`` actions per
call, so a tick does not start many L3 reads on one node at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from exaserve_hpc.protocol import L2Status
from exaserve_hpc.cache.l2_shm import READY, L2Entry, L2Full, choose_victims


@dataclass(frozen=True)
class PrefetchAction:
    model: str
    nbytes: int
    forecast: float  # requests per interval expected next
    evicts: tuple[str, ...] = ()  # models the agent's LRU will drop for it (all with a lower forecast)


def forecast(history: list[float], alpha: float = 0.5, trend_window: int = 3) -> float:
    """Next interval's demand: max(EWMA, linear trend over the last ``trend_window`` intervals), >= 0."""
    if not history:
        return 0.0
    ewma = history[0]
    for value in history[1:]:
        ewma = alpha * value + (1 - alpha) * ewma
    recent = history[-trend_window:]
    trend = recent[-1] + (recent[-1] - recent[0]) / max(1, len(recent) - 1)
    return max(0.0, ewma, trend)


def prefetch_plan(demand_history: dict[str, list[float]], l2: L2Status, model_bytes: dict[str, int], *,
                  min_forecast: float = 0.0, max_fills: int = 1) -> list[PrefetchAction]:
    """Models to load into this node's L2 next, most wanted first; see the module docstring."""
    wanted = {m: forecast(h) for m, h in demand_history.items()}
    in_l2 = {e.model for e in l2.entries}
    entries = [L2Entry(key=e.model, model=e.model, nbytes=e.nbytes, state=e.state,
                       pins={f"pin{i}" for i in range(e.pins)}, last_used=-e.idle_s) for e in l2.entries]
    filling = sum(e.state != READY for e in l2.entries)
    plan: list[PrefetchAction] = []
    candidates = sorted((m for m in wanted if m not in in_l2 and m in model_bytes and wanted[m] > min_forecast),
                        key=lambda m: (-wanted[m], m))
    for model in candidates:
        if len(plan) + filling >= max_fills:
            break
        try:
            victims = choose_victims(entries, model_bytes[model], l2.capacity)
        except L2Full:
            continue
        if any(wanted.get(v, 0.0) >= wanted[model] for v in victims):
            continue
        entries = [e for e in entries if e.key not in victims]
        entries.append(L2Entry(key=model, model=model, nbytes=model_bytes[model], state="filling"))
        plan.append(PrefetchAction(model, model_bytes[model], wanted[model], tuple(victims)))
    return plan
