"""Requests per model per interval, from the router's cumulative counters: the prefetch policy's input.

The router counts requests it accepted (one total, `accepted`); a per-model count is used when the
snapshot carries one (`accepted_by_model`). Without it the total's increase is shared among the
models in proportion to their outstanding requests (all to the one model of a single-model site),
an approximation that is exact for one model.

Pure: `observe(snapshot)` once per interval; no clock, no sockets.
"""

from __future__ import annotations

from collections import deque


class DemandHistory:
    def __init__(self, models: list[str], window: int = 12):
        self.models = list(models)
        self.window = window
        self._history: dict[str, deque[float]] = {m: deque(maxlen=window) for m in self.models}
        self._last_total: int | None = None
        self._last_by_model: dict[str, int] = {}

    def observe(self, snapshot: dict) -> None:
        by_model = snapshot.get("accepted_by_model")
        if isinstance(by_model, dict):
            for model in self.models:
                now = int(by_model.get(model, 0))
                before = self._last_by_model.get(model)
                self._last_by_model[model] = now
                if before is not None:
                    self._history[model].append(float(max(0, now - before)))
            return
        total = int(snapshot.get("accepted", 0))
        before, self._last_total = self._last_total, total
        if before is None:
            return
        delta = max(0, total - before)
        outstanding = {m: 0 for m in self.models}
        for replica in snapshot.get("replicas", []):
            if replica.get("model") in outstanding:
                outstanding[replica["model"]] += int(replica.get("outstanding", 0)) + int(replica.get("queue_depth", 0))
        weight = sum(outstanding.values())
        for model in self.models:
            share = (outstanding[model] / weight) if weight else 1.0 / max(1, len(self.models))
            self._history[model].append(delta * share)

    def history(self) -> dict[str, list[float]]:
        """Model -> requests per interval, oldest first (what prefetch_plan takes)."""
        return {m: list(h) for m, h in self._history.items()}
