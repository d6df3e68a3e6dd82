"""JSON-lines logs: the formatter's fields, the setting's check, and a real `exaserve serve` whose every
process (gateway, node agent, replicas) logs JSON lines, the gateway's naming the request it served."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from exaserve_hpc.observability.logs import REQUEST_ID, JsonLinesFormatter, LogFormatError, log_format

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_harness import stop_serve, write_local_site  # noqa: E402

from tests.waiting import wait_for  # noqa: E402


def record(msg: str, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("exaserve.router", logging.INFO, __file__, 1, msg, ("r1",) if "%s" in msg else (), None)
    rec.__dict__.update(extra)
    return rec


def test_a_line_is_one_object_with_the_request_id_where_known():
    line = json.loads(JsonLinesFormatter().format(record("retrying %s", request_id="cmpl-1")))
    assert line["msg"] == "retrying r1" and line["request_id"] == "cmpl-1" and line["level"] == "INFO"
    assert line["logger"] == "exaserve.router" and line["pid"] == os.getpid() and line["ts"].endswith("Z")
    assert "request_id" not in json.loads(JsonLinesFormatter().format(record("no request")))
    token = REQUEST_ID.set("cmpl-2")  # the gateway sets it for the task serving the request
    try:
        assert json.loads(JsonLinesFormatter().format(record("x")))["request_id"] == "cmpl-2"
    finally:
        REQUEST_ID.reset(token)
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record("failed", replica_id="tiny/r0000")
        rec.exc_info = sys.exc_info()
    line = json.loads(JsonLinesFormatter().format(rec))
    assert line["replica_id"] == "tiny/r0000" and "ValueError: boom" in line["exc"]


def test_an_unknown_format_names_the_setting_and_the_choices(monkeypatch):
    monkeypatch.setenv("EXASERVE_LOG_FORMAT", "xml")
    with pytest.raises(LogFormatError, match=r"'xml' \(--log-format or EXASERVE_LOG_FORMAT\) is not one of text, json"):
        log_format()
    assert log_format("JSON") == "json"


@pytest.mark.process
def test_serve_logs_json_lines_from_every_process_with_the_request_id(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "exaserve_hpc.cli", "--log-format", "json", "--log-level", "DEBUG", "serve",
         "--site", str(write_local_site(tmp_path)), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "EXASERVE_LOG_FORMAT": ""})
    lines: list[str] = []
    urls: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "exaserve is serving" in line:
                urls.append(line.split(" at ")[1].split("/v1")[0])

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 90
        while not urls:
            assert process.poll() is None and time.monotonic() < deadline, "".join(lines[-50:])
            time.sleep(0.1)
        body = json.dumps({"model": "tiny-llama", "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{urls[0]}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            rid = response.headers["X-Request-Id"]
        wait_for(lambda: any(rid in line for line in lines), 30, "the gateway's log line naming the request")
    finally:
        stop_serve(process, lines)
    logged = [json.loads(line) for line in lines if line.startswith("{")]
    loggers = {entry["logger"] for entry in logged}
    assert {"exaserve.controller", "exaserve.agent", "exaserve.replica"} <= loggers, sorted(loggers)
    assert len({entry["pid"] for entry in logged}) >= 3  # serve, its node agent, the replicas
    mine = [entry for entry in logged if entry.get("request_id") == rid]
    assert mine and mine[0]["logger"] == "exaserve_hpc.gateway.app" and rid in mine[0]["msg"]
    # Whatever is not a log line is the console's own output (progress, the serving banner), never a
    # text-format log line.
    assert not [line for line in lines if not line.startswith("{") and (" DEBUG " in line or " INFO " in line)]


def test_each_process_writes_its_own_capped_file_under_the_log_dir(tmp_path, monkeypatch):
    from exaserve_hpc.observability.logs import configure_logging
    monkeypatch.setenv("EXASERVE_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("EXASERVE_LOG_MAX_BYTES", "2048")
    monkeypatch.setenv("SLURM_PROCID", "3")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        path = configure_logging("INFO", "json")
        assert path.name.startswith("rank3.") and path.name.endswith(f".{os.getpid()}.log")
        for k in range(100):
            logging.getLogger("exaserve.test").info("line %d %s", k, "x" * 40)
        for handler in root.handlers:
            handler.flush()
        files = sorted(p.name for p in (tmp_path / "logs").iterdir())
        assert files == [path.name, path.name + ".1"]  # capped: the current file and one rotated
        assert path.stat().st_size <= 2048 and json.loads(path.read_text().splitlines()[-1])["msg"].startswith("line 99")
        monkeypatch.setenv("EXASERVE_LOG_MAX_BYTES", "lots")
        with pytest.raises(LogFormatError, match="EXASERVE_LOG_MAX_BYTES='lots' is not a number of bytes"):
            configure_logging("INFO", "json", role="replica")
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
