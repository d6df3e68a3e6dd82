"""Node failure on the local Slurm cluster: time from kill to detection and to serving again, and
requests sent vs completed across it (completed must equal sent).

    sudo python benchmarks/bench_failover.py [--rounds 3] [--heartbeat 2s] [--workers 4]

Brings tests/slurm/cluster.sh up (root), submits the real exaserve job (4 nodes, echo replicas),
drives a steady request stream through the gateway and kills one node (never rank 0's n1); each
round is a fresh job on a whole cluster. Prints one line per round plus medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "slurm"))

from fleet import SLURM_DIR, RequestStream, cluster, echo_site, kill_and_watch, submit, wait_serving  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heartbeat", default="2s")
    parser.add_argument("--misses", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    os.environ["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    cluster("up")
    results = []
    for round_ in range(args.rounds):
        node = ("n3", "n4", "n2")[round_ % 3]
        directory = Path(tempfile.mkdtemp(prefix="bench-failover-"))
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
