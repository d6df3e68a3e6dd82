"""`exaserve capacity`: a workload's peak rate and request mix -> replicas per model (controller/capacity.py,
30% headroom), then (--check) the simulator runs the workload on the site with exactly those replicas,
fixed, and says whether the answer holds the workload's SLO.
"""

from __future__ import annotations

import math
from typing import Optional


from exaserve_hpc.config.schema import SiteConfig, parse_site
from exaserve_hpc.controller.capacity import HEADROOM, RequestMix, replicas_for_mix
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.sim.workload import Workload, arrivals

WINDOW = 60.0  # seconds over which the peak rate is taken


def workload_mix(workload: Workload, duration: float, seed: int = 0,
                 max_seq: Optional[dict[str, int]] = None) -> list[RequestMix]:
    """Per model: the highest rate over any WINDOW-second window, and the mean prompt and output lengths,
    over the requests the gateway would accept (prompt + output within the model's max_seq_len)."""
    per: dict[str, list] = {}
    for r in arrivals(workload, duration, seed):
        if max_seq is not None and r.prompt + r.max_tokens > max_seq.get(r.model, 1 << 62):
            continue
        p = per.setdefault(r.model, [0, 0, 0, {}])
        p[0] += 1
        p[1] += r.prompt
        p[2] += r.max_tokens
        w = int(r.arrival // WINDOW)
        p[3][w] = p[3].get(w, 0) + 1
    return [RequestMix(m, max(p[3].values()) / min(WINDOW, duration), p[1] / p[0], p[2] / p[0])
            for m, p in sorted(per.items())]


def sized_site(site: SiteConfig, replicas: dict[str, int], floor: bool = True) -> SiteConfig:
    """The site with each model's replica count (and, with `floor`, its min_replicas) set to `replicas`;
    models not named keep theirs."""
    data = site.model_dump(mode="json", exclude_none=True)
    for m in data["models"]:
        if m["model_name"] in replicas:
            m["replicas"] = replicas[m["model_name"]]
            if floor:
                m["min_replicas"] = replicas[m["model_name"]]
    return parse_site(data)


def plan(site: SiteConfig, workload: Workload, headroom: float = HEADROOM) -> tuple[list[RequestMix], list]:
    specs = catalogue_from_site(site)
    share = {m.model_name: max(1, math.floor(1 / m.gpu_memory_utilization + 1e-9)) for m in site.models}
    mixes = workload_mix(workload, workload.duration, max_seq={m.model_name: m.max_seq_len for m in site.models})
    return mixes, replicas_for_mix(specs, mixes, share, headroom=headroom)


