"""Node failure on the local Slurm cluster: time from kill to detection and to serving again, and
requests sent vs completed across it (completed must equal sent).

    sudo python benchmarks/bench_failover.py [--rounds 3] [--heartbeat 2s] [--workers 4] [--replace]

Brings tests/slurm/cluster.sh up (root; one network and mount namespace per node, GRES GPUs, cgroups),
submits the real exaserve job (4 nodes, echo replicas),
drives a steady request stream through the gateway and kills one node (never rank 0's n1); each
round is a fresh job on a whole cluster. Prints one line per round plus medians.

--replace: a 3-node job started with --replace-lost-nodes (one replica per node at most) on the
4-node cluster; also times kill -> companion job queued -> replacement agent joined -> every
replica serving again on the planned number of nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "slurm"))

from fleet import (  # noqa: E402
    SLURM_DIR, RequestStream, cluster, echo_site, kill_and_watch, kill_and_watch_replacement, remove_shared_dir,
    replacement_site, shared_dir, submit, wait_serving,
)


def replace_rounds(args) -> int:
    results = []
    for round_ in range(args.rounds):
        directory = shared_dir("bench-replace")  # every node sees it (their /tmp is their own)
        site = replacement_site(directory, replicas=3, heartbeat=args.heartbeat, misses=args.misses)
        cluster("up")
        job = submit(site, directory / "jobs", nodes=3, launcher_args="--replace-lost-nodes --capacity-floor 0")
        node = None
        try:
            wait_serving(job, agents=3, replicas=3)
            nodes = json.loads((job.job_dir / "controller.json").read_text())["nodes"]
            node = nodes[-1]
            stream = RequestStream(job.url(), workers=args.workers, interval=0.05).start()
            time.sleep(3)
            timings, _ = kill_and_watch_replacement(job, node, nodes, 3, stream)
        finally:
            job.cancel()
            subprocess.run(["scancel", f"--name=exaserve-replace-{job.job_id}"], capture_output=True)
            if node:
                cluster("revive-node", node, check=False)
            remove_shared_dir(directory)
        results.append(timings)
        print(f"round {round_ + 1}: job {job.job_id}, killed {node}: {timings.report()}", flush=True)
    if not results or not all(r.restored_at for r in results):
        print("some round never got its capacity back")
        return 1

    def median(attr: str) -> float:
        return statistics.median(getattr(r, attr) - r.killed_at for r in results)
    sent, completed = sum(r.sent for r in results), sum(r.completed for r in results)
    print(f"median over {len(results)} rounds (heartbeat {args.heartbeat} x {args.misses}): kill -> detected "
          f"{median('detected_at'):.2f}s, -> companion job {median('submitted_at'):.2f}s, -> replacement joined "
          f"{median('joined_at'):.2f}s, -> all replicas serving {median('restored_at'):.2f}s; requests sent {sent}, "
          f"completed {completed}")
    return 0 if sent == completed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heartbeat", default="2s")
    parser.add_argument("--misses", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--replace", action="store_true", help="time a replacement allocation instead")
    args = parser.parse_args()
    os.environ["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    cluster("up")
    if args.replace:
        return replace_rounds(args)
    results = []
    for round_ in range(args.rounds):
        node = ("n3", "n4", "n2")[round_ % 3]
        directory = shared_dir("bench-failover")
        site = echo_site(directory, replicas=args.replicas, heartbeat=args.heartbeat, misses=args.misses)
        cluster("up")  # every node back (ReturnToService=2) before each round's fresh job
        job = submit(site, directory / "jobs", nodes=4)
        try:
            wait_serving(job, agents=4, replicas=args.replicas)
            stream = RequestStream(job.url(), workers=args.workers, interval=0.05).start()
            time.sleep(3)
            timings, _ = kill_and_watch(job, node, args.replicas, stream)
        finally:
            job.cancel()
            cluster("revive-node", node, check=False)
            remove_shared_dir(directory)
        results.append(timings)
        failed = stream.failed
        print(f"round {round_ + 1}: job {job.job_id}, killed {node}: {timings.report()}"
              + (f"; FAILED {len(failed)}: {failed[0].detail}" if failed else ""), flush=True)
    if results:
        if not all(r.detected_at and r.serving_at for r in results):
            print("some round never detected the loss or never served again")
            return 1
        detect = statistics.median(r.detected_at - r.killed_at for r in results)
        serve = statistics.median(r.serving_at - r.killed_at for r in results)
        sent = sum(r.sent for r in results)
        completed = sum(r.completed for r in results)
        print(f"median over {len(results)} rounds (heartbeat {args.heartbeat} x {args.misses}): kill -> detected "
              f"{detect:.2f}s, kill -> serving again {serve:.2f}s; requests sent {sent}, completed {completed}")
        return 0 if sent == completed else 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
