"""Controller high availability through etcd (issue 18).

    etcd_client.py   the one seam to etcd (etcd3gw, the v3 HTTP/JSON gateway), several endpoints
    etcd_member.py   start and stop an etcd member inside the allocation
    etcd_tls.py      the job's CA and certificates (members and clients authenticate both ways)
    lease_policy.py  pure: when a leader acts, renews or steps down
    election.py      campaign, lease renewal, fenced writes (the leader's election key's create_revision)
    fleet_store.py   the fleet state (the checkpoint's content) under the job's etcd prefix
    launch.py        `exaserve launch` with `ha.etcd`: members, candidates, the leader's control plane
    follow.py        agents re-register with the leader the job directory names
    adoption.py      pure: with several routers, which a new leader adopts and which replicas it keeps
"""
