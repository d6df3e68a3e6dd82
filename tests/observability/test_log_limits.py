"""Logs that a flood cannot grow without bound and nobody else can read (issue 25 item 3): repeated warnings
and errors are rate-limited per kind with a count; every process's log file is 0600 from its first byte,
whatever the umask, also after a rotation and when it is opened before `serve` sets its umask."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys

from exaserve_hpc.observability.logs import PrivateRotatingFileHandler, RepeatFilter


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def handler_with_filter(clock, **kw):
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    handler.addFilter(RepeatFilter(handler, interval=10.0, burst=3, clock=clock, **kw))
    logger = logging.getLogger(f"test.repeat.{id(handler)}")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    return logger, records


def test_a_flood_of_one_error_is_a_few_lines_and_one_count_per_interval():
    clock = Clock()
    logger, records = handler_with_filter(clock)
    for i in range(10_000):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            logger.exception("socket.accept() out of system resource (%d)", i)
    assert len(records) == 3  # the burst, then only counted
    clock.now += 11
    logger.error("socket.accept() out of system resource (%d)", 10_000)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 5, lines
    assert lines[3].startswith("9997 more like this were suppressed in the last 11s"), lines[3]
    assert "(9999)" in lines[3]  # the latest suppressed one is named


def test_other_kinds_info_lines_and_new_intervals_are_not_limited():
    clock = Clock()
    logger, records = handler_with_filter(clock)
    for i in range(50):
        logger.info("request %s done", i)  # INFO: never limited
    for node in ("n1", "n2", "n3"):
        logger.error("node %s lost", node)
    logger.warning("another kind")
    assert len(records) == 50 + 3 + 1


def test_a_count_left_when_the_flood_stops_is_written_with_the_next_line_of_any_kind():
    clock = Clock()
    logger, records = handler_with_filter(clock)
    for _ in range(100):
        logger.warning("malformed frame from %s", "peer")
    clock.now += 30
    logger.warning("something else")
    lines = [r.getMessage() for r in records]
    assert any(line.startswith("97 more like this were suppressed") for line in lines), lines
    assert lines[-1] == "something else"


def test_log_files_are_private_from_the_first_byte_and_after_rotation(tmp_path):
    old = os.umask(0o022)
    try:
        handler = PrivateRotatingFileHandler(tmp_path / "rank0.log", maxBytes=1024, backupCount=1)
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "x" * 600, None, None)
        for _ in range(5):
            handler.emit(record)
        handler.close()
    finally:
        os.umask(old)
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["rank0.log", "rank0.log.1"]
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}


def test_a_process_log_opened_before_any_umask_is_0600(tmp_path):
    """What `exaserve serve` / `launch` do: configure_logging (cli.main) runs before they set umask 077."""
    code = ("import os, logging; os.umask(0o022)\n"
            "from exaserve_hpc.observability.logs import configure_logging\n"
            "path = configure_logging('WARNING', 'text', role='exaserve')\n"
            "logging.getLogger('t').warning('hello'); print(path)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "EXASERVE_LOG_DIR": str(tmp_path / "logs")})
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip().splitlines()[-1]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert "hello" in open(path).read()
