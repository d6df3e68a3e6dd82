"""A controller candidate as its own process, for the election tests: campaigns, and while `acting()`
makes one fenced write every 0.1 s ("act" lines, wall time), like a controller's decisions.

    python tests/ha/candidate.py --endpoints URL,URL --prefix /p --name a --ttl 2 [--probe-after-deposed]

Each line: `<wall time> <event> <detail>`. With --probe-after-deposed, once deposed it keeps trying a
raw fenced write with its old revision (what a deposed leader that had not noticed would send) and
prints `stale-write <succeeded>` each time it reaches etcd.
"""

import argparse
import sys
import time

from exaserve_hpc.ha.election import Deposed, Election
from exaserve_hpc.ha.etcd_client import EtcdClient, EtcdUnavailable
from exaserve_hpc.ha.etcd_tls import TlsFiles
from exaserve_hpc.ha.lease_policy import LeaseTiming


def say(event: str, detail: str = "") -> None:
    print(f"{time.time():.3f} {event} {detail}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoints", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--ttl", type=float, default=2.0)
    p.add_argument("--probe-after-deposed", action="store_true")
    p.add_argument("--tls", default="", help="CA,CERT,KEY of the client certificate")
    args = p.parse_args()
    timing = LeaseTiming.from_settings(args.ttl)
    etcd = EtcdClient(args.endpoints.split(","), timeout=min(1.0, timing.renew_interval),
                      tls=TlsFiles(*args.tls.split(",")) if args.tls else None)
    election = Election(etcd, args.prefix, args.name, timing,
                        on_elected=lambda e: say("elected", str(e.revision)),
                        on_deposed=lambda why: say("deposed", why)).start()
    count, old_revision = 0, 0
    while True:
        if election.acting():
            old_revision = election.revision
            count += 1
            try:
                election.fenced_put({f"{args.prefix}/fleet/tick": f"{args.name} {count}"})
                say("act", str(count))
            except Deposed as exc:
                say("refused", str(exc))
            except EtcdUnavailable as exc:
                say("unreachable", str(exc)[:80])
        elif old_revision and args.probe_after_deposed:
            try:
                ok = etcd.put_if_created_at(election.key, old_revision, {f"{args.prefix}/fleet/tick": "stale"})
                say("stale-write", str(ok))
            except EtcdUnavailable:
                say("stale-unreachable")
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
