"""Hypothesis strategies for random clusters and catalogues, built through the real config loader."""

from __future__ import annotations

from hypothesis import strategies as st

from exaserve_hpc.config.schema import SiteConfig, parse_site
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.topology import topology_from_site

GiB = 2**30


@st.composite
def sites(draw, max_nodes: int = 10, max_models: int = 4) -> SiteConfig:
    nodes = draw(st.integers(1, max_nodes))
    gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
    cluster = {"nodes": nodes, "gpus_per_node": gpus, "fault_group_size": draw(st.integers(1, 4))}
    if gpus:
        cluster["gpu_memory"] = draw(st.sampled_from([16, 40, 80])) * GiB
        cluster["nvlink_domain_size"] = draw(st.sampled_from([d for d in (1, 2, 4, 8) if gpus % d == 0]))
    else:
        cluster["host_memory"] = draw(st.sampled_from([1, 4, 64])) * GiB
    models = []
    device_memory = cluster.get("gpu_memory") or cluster["host_memory"]
    for k in range(draw(st.integers(1, max_models))):
        tp = draw(st.sampled_from([1, 1, 2, 4, 8] if gpus else [1, 1, 2]))
        pp = draw(st.sampled_from([1, 1, 1, 2, 3]))
        fraction = draw(st.sampled_from([0.1, 0.2, 0.25, 0.3, 0.45, 0.5, 0.9]))
        # mostly fits its reservation; now and then (share > 1) it cannot
        share = draw(st.integers(0, 11)) / 10 * (fraction if gpus else 0.3)
        models.append({
            "model_name": f"m{k}",
            "tensor_parallel": tp,
            "pipeline_parallel": pp,
            "gpu_memory_utilization": fraction,
            "weight_bytes": int(share * tp * pp * device_memory) // 2,
            "kv_bytes_per_token": draw(st.sampled_from([0, 1024, 65536])),
            "max_seq_len": 2048,
            "priority": draw(st.integers(0, 100)),
            "replicas": draw(st.integers(0, 24)),
            "min_replicas": draw(st.integers(0, 3)),
        })
    sched = {"max_replicas_per_node": draw(st.integers(1, 8)), "min_replicas_per_model": 1}
    return parse_site({"site": "random", "cluster": cluster, "scheduler": sched, "models": models})


def parts(site: SiteConfig):
    return topology_from_site(site), catalogue_from_site(site), site.scheduler.max_replicas_per_node
