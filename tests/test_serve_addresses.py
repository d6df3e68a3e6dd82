"""Addresses through a real `exaserve serve`: a bad interface or a busy port is a clear error at start,
naming the setting; a wildcard gateway is published as the node's address, never 0.0.0.0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest

from serve_harness import start_serve, write_local_site

pytestmark = pytest.mark.process


def serve_fails(site_file) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(site_file), "--port", "0"],
                          capture_output=True, text=True, timeout=60)


def test_an_interface_this_node_lacks_is_refused_at_start(tmp_path):
    result = serve_fails(write_local_site(tmp_path, gateway={"interface": "nosuch0"}))
    assert result.returncode == 1
    assert "gateway.interface: no interface 'nosuch0' on this node" in result.stderr and "lo (" in result.stderr


def test_a_busy_router_port_is_refused_at_start_naming_the_setting(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = serve_fails(write_local_site(tmp_path, router={"frontend_port": port}))
    assert result.returncode == 1
    assert f"frontend_port {port}" in result.stderr and "router.frontend_port" in result.stderr


def test_a_wildcard_gateway_publishes_the_nodes_address(tmp_path):
    process, url, lines = start_serve(write_local_site(tmp_path, gateway={"host": "0.0.0.0"}))
    try:
        published = json.loads((tmp_path / "run" / "serve.json").read_text())["url"]
        assert published == url and "0.0.0.0" not in url
        status = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir",
                                 str(tmp_path / "run")], capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, "".join(lines)


def test_a_node_granted_fewer_gpus_than_the_site_asks_stops_serve_with_the_agents_message(tmp_path):
    import os
    site_file = write_local_site(tmp_path, cluster={"gpus_per_node": 2, "gpu_memory": "80GiB"})
    env = {**os.environ, "SLURM_STEP_GPUS": "0"}  # the step was granted one GPU
    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(site_file),
                             "--port", "0"], capture_output=True, text=True, timeout=90, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "cluster.gpus_per_node" in output and "agent exited with status 2" in output
