"""Pure parsers for what Slurm's commands print; tested on samples captured from Slurm 22.05.

    parse_sbatch_parsable("1234;cluster\\n")   -> 1234
    parse_squeue_json(text)                    -> [JobInfo]
    parse_sinfo_json(text)                     -> [NodeInfo]
    parse_scontrol_show(text)                  -> [{"JobId": "1", ...}]   (`scontrol show ... -o`)
    job_from_scontrol(record), node_from_scontrol(record)

No subprocess here: the client runs the commands and hands us their stdout.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from exaserve_hpc.config.hostlist import expand_hostlist
from exaserve_hpc.batch.slurm.states import JobState, NodeState, job_state, node_state


class SlurmParseError(ValueError):
    """Slurm printed something we cannot read; the message quotes the start of it."""


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    name: str
    state: JobState
    raw_state: str          # Slurm's own word, for logs
    reason: str = ""
    nodes: tuple[str, ...] = ()
    node_count: int = 0
    partition: str = ""
    account: str = ""
    qos: str = ""
    restarts: int = 0
    requeue: bool = False
    batch_host: str = ""
    time_limit_s: Optional[int] = None  # None: unlimited
    start_time: int = 0
    exit_code: Optional[int] = None
    excluded_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: NodeState
    raw_state: str
    reason: str = ""
    cpus: int = 0
    alloc_cpus: int = 0
    partitions: tuple[str, ...] = ()
    hostname: str = ""
    port: int = 0
    extras: dict = field(default_factory=dict, compare=False)


def parse_sbatch_parsable(text: str) -> int:
    """`sbatch --parsable` prints "JOBID" or "JOBID;CLUSTER" (after any warnings on stderr)."""
    for line in reversed(text.strip().splitlines()):
        head = line.strip().split(";", 1)[0]
        if head.isdigit():
            return int(head)
    raise SlurmParseError(f"no job id in sbatch --parsable output: {text[:200]!r}")


def _load_json(text: str, what: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmParseError(f"{what} did not print JSON ({exc}): {text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise SlurmParseError(f"{what} printed {type(data).__name__}, expected an object")
    errors = [e for e in data.get("errors", []) if e]
    if errors:
        raise SlurmParseError(f"{what} reported errors: {errors}")
    return data


def _number(value: Any) -> Optional[int]:
    """22.05 prints plain numbers; 23.02+ prints {"set": true, "infinite": false, "number": N}."""
    if isinstance(value, dict):
        if value.get("infinite") or not value.get("set", True):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _hosts(expr: Any) -> tuple[str, ...]:
    if not expr or not isinstance(expr, str) or expr in {"(null)", "None"}:
        return ()
    return tuple(expand_hostlist(expr))


def _state_text(raw: Any) -> str:
    return "+".join(raw) if isinstance(raw, list) else str(raw or "")


def parse_squeue_json(text: str) -> list[JobInfo]:
    jobs = []
    for job in _load_json(text, "squeue --json").get("jobs", []):
        limit_min = _number(job.get("time_limit"))
        exit_code = job.get("exit_code")
        if isinstance(exit_code, dict):  # 23.02+: {"status": ..., "return_code": N}
            exit_code = _number(exit_code.get("return_code"))
        elif exit_code is not None:
            exit_code = int(exit_code) >> 8 if int(exit_code) > 255 else int(exit_code)  # 22.05: wait status
        jobs.append(JobInfo(
            job_id=int(_number(job.get("job_id")) or 0),
            name=str(job.get("name", "")),
            state=job_state(job.get("job_state")),
            raw_state=_state_text(job.get("job_state")),
            reason=_null(str(job.get("state_reason") or "")),
            nodes=_hosts(job.get("nodes")),
            node_count=int(_number(job.get("node_count")) or 0),
            partition=str(job.get("partition") or ""),
            account=str(job.get("account") or ""),
            qos=str(job.get("qos") or ""),
            restarts=int(_number(job.get("restart_cnt")) or 0),
            requeue=bool(job.get("requeue")),
            batch_host=str(job.get("batch_host") or ""),
            time_limit_s=None if limit_min is None else limit_min * 60,
            start_time=int(_number(job.get("start_time")) or 0),
            exit_code=exit_code,
            excluded_nodes=_hosts(job.get("excluded_nodes")),
        ))
    return jobs


def parse_sinfo_json(text: str) -> list[NodeInfo]:
    nodes = []
    for node in _load_json(text, "sinfo --json").get("nodes", []):
        raw, flags = node.get("state"), node.get("state_flags") or []
        nodes.append(NodeInfo(
            name=str(node.get("name", "")),
            state=node_state(raw, flags),
            raw_state="+".join([_state_text(raw)] + [str(f) for f in flags]),
            reason=str(node.get("reason") or ""),
            cpus=int(_number(node.get("cpus")) or 0),
            alloc_cpus=int(_number(node.get("alloc_cpus")) or 0),
            partitions=tuple(node.get("partitions") or ()),
            hostname=str(node.get("hostname") or ""),
            port=int(_number(node.get("port")) or 0),
        ))
    return nodes


_PAIR_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_scontrol_show(text: str) -> list[dict[str, str]]:
    """`scontrol show job|node ... -o`: one record per line of Key=Value pairs.

    Values may contain spaces (Reason=Not responding [root@...], OS=Linux 6.1 #1 SMP ...):
    a value runs until the next ` Key=`.
    """
    records = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        matches = list(_PAIR_RE.finditer(line))
        if not matches or matches[0].start() != 0:
            raise SlurmParseError(f"not a `scontrol show -o` line: {line[:200]!r}")
        record = {}
        for i, match in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            record[match.group(1)] = line[match.end():end].strip()
        records.append(record)
    return records


def _null(value: str) -> str:
    return "" if value in {"(null)", "N/A", "None"} else value


def _duration_s(text: str) -> Optional[int]:
    """Slurm's [days-]hours:minutes:seconds (or minutes:seconds); UNLIMITED -> None."""
    if not text or text.upper() in {"UNLIMITED", "INFINITE", "N/A", "NONE"}:
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days) if days else 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


def job_from_scontrol(record: dict[str, str]) -> JobInfo:
    exit_code = record.get("ExitCode", "")
    return JobInfo(
        job_id=int(record["JobId"]),
        name=record.get("JobName", ""),
        state=job_state(record.get("JobState")),
        raw_state=record.get("JobState", ""),
        reason=_null(record.get("Reason", "")),
        nodes=_hosts(_null(record.get("NodeList", ""))),
        node_count=int(record.get("NumNodes", "0").split("-")[0] or 0),
        partition=_null(record.get("Partition", "")),
        account=_null(record.get("Account", "")),
        qos=_null(record.get("QOS", "")),
        restarts=int(record.get("Restarts", "0") or 0),
        requeue=record.get("Requeue", "0") == "1",
        batch_host=_null(record.get("BatchHost", "")),
        time_limit_s=_duration_s(record.get("TimeLimit", "")),
        exit_code=int(exit_code.split(":")[0]) if exit_code[:1].isdigit() else None,
        excluded_nodes=_hosts(_null(record.get("ExcNodeList", ""))),
    )


def node_from_scontrol(record: dict[str, str]) -> NodeInfo:
    return NodeInfo(
        name=record["NodeName"],
        state=node_state(record.get("State", "")),
        raw_state=record.get("State", ""),
        reason=_null(record.get("Reason", "")),
        cpus=int(record.get("CPUTot", "0") or 0),
        alloc_cpus=int(record.get("CPUAlloc", "0") or 0),
        partitions=tuple(p for p in _null(record.get("Partitions", "")).split(",") if p),
        hostname=_null(record.get("NodeHostName", "")),
        port=int(record.get("Port", "0") or 0),
    )
