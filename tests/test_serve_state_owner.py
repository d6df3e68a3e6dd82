"""serve.json's owner (control_plane.written_by, pure): a stopping plane removes the file only when it wrote it.
Under ha.etcd a deposed leader and the new one, on different nodes, may have the same pid; the file the new
leader wrote in the shared job directory must stay."""

from __future__ import annotations

import json
import os
import socket

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.app.control_plane import write_state, written_by


def test_only_the_process_that_wrote_serve_json_owns_it(tmp_path):
    site = parse_site({"site": "owner", "models": [{"model_name": "m", "max_seq_len": 256}]})
    url = "http://10.0.0.1:8000"
    state = json.loads(write_state(tmp_path, url, site).read_text())
    me, pid = socket.gethostname(), os.getpid()
    assert state["host"] == me and state["pid"] == pid
    assert written_by(state, url, pid, me)
    # the new leader, on another node, with this very pid: not ours
    assert not written_by({**state, "host": "other-node", "url": "http://10.0.0.2:8000"}, url, pid, me)
    assert not written_by({**state, "host": "other-node"}, url, pid, me)
    assert not written_by({**state, "url": "http://10.0.0.2:8000"}, url, pid, me)
    assert not written_by({**state, "pid": pid + 1}, url, pid, me)
    assert not written_by({"url": url, "pid": pid}, url, pid, me), "a file without a host is not known to be ours"
