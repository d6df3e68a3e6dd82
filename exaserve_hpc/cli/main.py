"""The `exaserve` command: a thin dispatcher; each command's work lives in its own module.

Exit codes: 0 success, 1 runtime failure, 2 bad input (config, arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

import yaml
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from exaserve_hpc import __version__
from exaserve_hpc.app.rank import add_launch_arguments, cmd_launch
from exaserve_hpc.app.serve import ServeError, ServeOptions, serve
from exaserve_hpc.cache.checkpoint import CheckpointError, TinyModelSpec, create_tiny_checkpoint, verify_checkpoint
from exaserve_hpc.cache.manifest import MANIFEST_FILE
from exaserve_hpc.cache.model_import import import_model
from exaserve_hpc.cli import simulate as simulate_cli
from exaserve_hpc.cli.console import err, load_site_arg, out, running_server_url
from exaserve_hpc.cli.quota import add_keys_arguments, add_usage_arguments
from exaserve_hpc.cli.rollout import add_rollout_arguments, admin_headers, cmd_rollout
from exaserve_hpc.cli.simulate import add_capacity_arguments, add_simulate_arguments
from exaserve_hpc.cli.submit import add_submit_arguments, cmd_submit
from exaserve_hpc.config.schema import ConfigError, load_site, resolve_site
from exaserve_hpc.modulefiles import add_modules_arguments
from exaserve_hpc.observability.logs import configure_logging
from exaserve_hpc.observability.watch import watch
from exaserve_hpc.batch.slurm.accounts import AccountError, check_accounts
from exaserve_hpc.quota.keys import key_file_problems, plaintext_warnings
from exaserve_hpc.controller.plan_report import add_plan_arguments, cmd_plan
from exaserve_hpc.units import format_size

# ---------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    site = load_site_arg(args.site)
    options = ServeOptions(host=args.host, port=args.port, run_dir=Path(args.run_dir) if args.run_dir else None)
    try:
        return serve(site, options)
    except ServeError as exc:
        err.print(f"[red]error[/]: {exc}", highlight=False)
        return 1


# ---------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    url = running_server_url(args)
    status_request = urllib.request.Request(f"{url}/v1/exaserve/status", headers=admin_headers(args))
    if args.watch:  # a live view (observability/watch.py)

        def fetch() -> dict:
            with urllib.request.urlopen(status_request, timeout=args.timeout) as response:
                return json.load(response)
        return watch(fetch, url, interval=args.interval, count=args.count, console=out)
    try:
        with urllib.request.urlopen(status_request, timeout=args.timeout) as response:
            status = json.load(response)
    except (urllib.error.URLError, OSError) as exc:
        err.print(f"[red]error[/]: cannot reach exaserve at {url}: {getattr(exc, 'reason', exc)}", highlight=False)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    render_status(status, url)
    return 0


def render_status(status: dict, url: str) -> None:
    controller = status.get("controller", {})
    router = status.get("router", {})
    out.print(f"[bold]exaserve[/] site {status.get('site')} at {url}  controller {controller.get('endpoint')}  "
              f"router in-flight {router.get('inflight', 0)} pending {router.get('pending', 0)} "
              f"completed {router.get('completed', 0)} failed {router.get('failed', 0)} "
              f"retries {router.get('retries', 0)}", highlight=False)
    if router.get("routers"):  # several routers share the fleet (router.count > 1), each with a gateway
        routers = Table(title="routers")
        for column in ("router", "state", "gateway", "frontend", "backend", "replicas", "accepted", "in flight"):
            routers.add_column(column)
        for r in router["routers"]:
            routers.add_row(str(r["index"]), r["state"], r["gateway"] or "-", r["frontend"], r["backend"],
                            str(r["replicas"]), str(r["accepted"]), str(r["inflight"]))
        out.print(routers)
    agents = Table(title="node agents")
    for column in ("agent", "host", "pid", "state", "heartbeat age", "GPUs"):
        agents.add_column(column)
    for a in status.get("agents", []):
        agents.add_row(a["agent_id"], a["hostname"], str(a["pid"]), a["state"], f"{a['heartbeat_age']:.1f}s",
                       str(a["gpus"]))
    out.print(agents)
    if status.get("models"):
        out.print(_models_table(status["models"]))
    replicas = Table(title="replicas")
    # "via router": replicas connect out to a router's backend (they listen on nothing): which one
    for column in ("replica", "model", "state", "node", "devices", "pid", "via router", "queue", "in flight",
                   "restarts", "weights"):
        replicas.add_column(column)
    for r in status.get("replicas", []):
        model = f"{r['model']}@{r['version']}" if r.get("version") else r["model"]
        devices = ",".join(r.get("devices") or ["-"])  # the replica's CUDA_VISIBLE_DEVICES
        state = r["state"]
        if state == "serving" and (r.get("silent_s") or 0) > SILENT_SHOWN:  # hung or stopped (SIGSTOP)
            state = f"serving, silent {r['silent_s']:.0f}s"
        elif state == "serving" and r.get("routed") is False:  # its router dropped it (silent past its expiry)
            state = "serving, not routed"
        replicas.add_row(r["replica_id"], model, state, str(r["node"] or "-"), devices, str(r["pid"] or "-"),
                         str(r["endpoint"] or "-"), str(r["queue_depth"]), str(r["outstanding"]), str(r["restarts"]),
                         _weights_column(r))
    out.print(replicas)


SILENT_SHOWN = 5.0  # seconds: a serving replica unheard this long is shown as silent (it reports every second)


def _models_table(models: list[dict]) -> Table:
    """Per model: replicas serving / wanted, the floor, and the autoscaler's last scaling with its reason."""
    table = Table(title="models")
    for column in ("model", "serving/target", "min", "stopping", "load", "last scale"):
        table.add_column(column)
    for m in models:
        scaled = m.get("last_scale")
        table.add_row(m["model"], f"{m['current']}/{m['target']}", str(m["min_replicas"]), str(m["stopping"]),
                      "-" if m.get("load") is None else f"{m['load']:.2f}",
                      scaled["reason"] if scaled else "-")  # the reason names the counts
    return table


def _weights_column(replica: dict) -> str:
    """Load progress while weights stream in (e.g. "l3 42%"), the source once loaded."""
    progress, source = replica.get("load_progress"), replica.get("load_source") or ""
    if progress is None:
        return "-"
    if progress < 1.0 and replica.get("state") in ("reserving", "loading"):
        return f"{source or 'loading'} {progress:.0%}"
    return source or "-"


# ---------------------------------------------------------------- config


def cmd_config_check(args: argparse.Namespace) -> int:
    failed = 0
    for name in args.files:
        try:
            site = load_site(resolve_site(name))
        except ConfigError as exc:
            err.print(str(exc), highlight=False, markup=False)
            failed += 1
            continue
        if problems := key_file_problems(site):
            for problem in problems:
                err.print(f"{name}: {problem}", highlight=False, markup=False)
            failed += 1
            continue
        replicas = sum(site.initial_replicas(m) for m in site.models)
        out.print(f"{name}: ok (site {site.site}, {site.cluster.nodes} node(s), {len(site.models)} model(s), "
                  f"{replicas} replica(s))", highlight=False)
        for warning in site.engine_warnings() + plaintext_warnings(site):
            err.print(f"{name}: warning: {warning}", highlight=False, markup=False)
        if args.accounts:  # quota groups' Slurm accounts exist and this user may charge them (sacctmgr)
            try:
                check_accounts(site, user=os.environ.get("USER") or None)
            except AccountError as exc:
                err.print(f"{name}: {exc}", highlight=False, markup=False)
                failed += 1
    return 2 if failed else 0


def cmd_config_show(args: argparse.Namespace) -> int:
    site = load_site(resolve_site(args.file))
    data = site.model_dump(mode="json")
    print(json.dumps(data, indent=2) if args.json else yaml.safe_dump(data, sort_keys=False), end="")
    return 0


# ---------------------------------------------------------------- model


def cmd_model_create_tiny(args: argparse.Namespace) -> int:
    spec = TinyModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                         intermediate=args.intermediate, max_position=args.max_position, seed=args.seed,
                         shards=args.shards)
    path = create_tiny_checkpoint(Path(args.dir), spec)
    out.print(f"created {path}", highlight=False)
    return 0


def cmd_model_verify(args: argparse.Namespace) -> int:
    try:
        verify_checkpoint(Path(args.dir))
    except CheckpointError as exc:
        err.print(f"[red]verification failed[/]: {exc}", highlight=False)
        return 1
    out.print(f"{args.dir}: every file matches its manifest (size and every recorded digest: blake3, sha256, md5)", highlight=False)
    return 0


def cmd_model_import(args: argparse.Namespace) -> int:
    store = Path(args.store).expanduser() if args.store else load_site_arg(args.site).weight_cache.l3_dir
    started = time.monotonic()

    def terminated(signum, frame):  # scancel, a job's time limit: clean up as for Ctrl-C
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, disable=not err.is_terminal, transient=True) as progress:
        task = progress.add_task(f"import {args.name}", total=None)
        try:
            dest = import_model(Path(args.src), store, args.name, force=args.force,
                                progress=lambda done, total: progress.update(task, completed=done, total=total),
                                note=lambda text: err.print(f"note: {text}", highlight=False, markup=False))
        except CheckpointError as exc:
            err.print(f"[red]import failed[/]: {exc}", highlight=False)
            return 2
        except KeyboardInterrupt:
            err.print(f"interrupted: nothing was changed at {store / args.name}", highlight=False, markup=False)
            return 130
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    files = json.loads((dest / MANIFEST_FILE).read_bytes())["files"]
    size, seconds = sum(f["size"] for f in files.values()), time.monotonic() - started
    if "@" in args.name:
        base, version = args.name.split("@", 1)
        step = (f"start a rollout: exaserve rollout start {base} {version} (its default --model-dir is the "
                f"checkpoint of model {base} + '@{version}'; else pass --model-dir {dest})")
    else:
        step = (f"name it in a site config: model_path: {dest}  or  model_name: {args.name} under "
                f"weight_cache.l3_path: {store}")
    out.print(f"imported {args.name} -> {dest}: {len(files)} files + {MANIFEST_FILE}, {format_size(size)} "
              f"({size} bytes) in {seconds:.1f}s; next: {step}", highlight=False, markup=False)
    return 0


# ---------------------------------------------------------------- parser


# ---------------------------------------------------------------- simulate, capacity (sim/)


def cmd_simulate(args: argparse.Namespace) -> int:
    return simulate_cli.cmd_simulate(args, load_site_arg(args.site), err)


def cmd_capacity(args: argparse.Namespace) -> int:
    return simulate_cli.cmd_capacity(args, load_site_arg(args.site), out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exaserve", description="Serve LLMs inside a Slurm allocation.")
    parser.add_argument("--version", action="version", version=f"exaserve-hpc {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("EXASERVE_LOG_LEVEL", "WARNING"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default=os.environ.get("EXASERVE_LOG_FORMAT", "text"), choices=["text", "json"],
                        help="text, or json: one JSON object a line with the request id where known "
                             "(default $EXASERVE_LOG_FORMAT or text)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    site_help = "site name (looked up in site-configs/) or YAML path; default $EXASERVE_SITE or local"

    serve = commands.add_parser("serve", help="run controller, router, gateway and replicas on this machine")
    serve.add_argument("--site", help=site_help)
    serve.add_argument("--host", help="gateway address (default: gateway.host)")
    serve.add_argument("--port", type=int, help="gateway port (default: gateway.port; 0 picks a free one)")
    serve.add_argument("--run-dir", help="where the running server records its URL (default: run_dir)")
    serve.set_defaults(func=cmd_serve)

    status = commands.add_parser("status", help="show the controller, node agents and replicas")
    status.add_argument("--url", help="gateway URL (default: the running server recorded in run_dir)")
    status.add_argument("--site", help=site_help)
    status.add_argument("--run-dir")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--timeout", type=float, default=5.0)
    status.add_argument("--watch", action="store_true",
                        help="live view: nodes, models, busiest replicas, load and alerts, refreshed until Ctrl-C")
    status.add_argument("--interval", type=float, default=2.0, help="--watch: seconds between refreshes (default 2)")
    status.add_argument("--count", type=int, help="--watch: stop after this many refreshes")
    status.set_defaults(func=cmd_status)

    config = commands.add_parser("config", help="check or show site configs")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_commands.add_parser("check", help="validate site config files (exit 2 on any error)")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("--accounts", action="store_true",
                       help="also check quota groups' Slurm accounts exist and $USER may charge them (sacctmgr)")
    check.set_defaults(func=cmd_config_check)
    show = config_commands.add_parser("show", help="print the resolved config with every default")
    show.add_argument("file", metavar="FILE")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_config_show)

    plan = commands.add_parser("plan", help="place a site's replicas and print the plan")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    simulate = commands.add_parser("simulate", help="simulate a workload on a site: the real controller and router "
                                                    "in simulated time, with faults; report with plots")
    add_simulate_arguments(simulate, site_help)
    simulate.set_defaults(func=cmd_simulate)
    capacity = commands.add_parser("capacity", help="replicas per model for a workload's request rate and mix "
                                                    "(30%% headroom), checked by the simulator")
    add_capacity_arguments(capacity, site_help)
    capacity.set_defaults(func=cmd_capacity)


    submit = commands.add_parser("submit", help="render the sbatch script from a site config and submit it")
    add_submit_arguments(submit)
    submit.set_defaults(func=cmd_submit)

    launch = commands.add_parser("launch", help="one rank of a batch job: controller on rank 0, node agent elsewhere "
                                                "(the sbatch script runs this under srun)")
    add_launch_arguments(launch)
    launch.set_defaults(func=cmd_launch)

    modules = commands.add_parser("modules", help="publish this install as an environment module (Lmod or Tcl)")
    add_modules_arguments(modules)

    rollout = commands.add_parser("rollout", help="canary rollout of a model version: start, promote, rollback")
    add_rollout_arguments(rollout)
    rollout.set_defaults(func=cmd_rollout)

    keys = commands.add_parser("keys", help="API keys of quota groups (stored hashed)")
    add_keys_arguments(keys, site_help)
    usage = commands.add_parser("usage", help="tokens, GPU-seconds and requests from the usage ledger, per "
                                              "account, group or model")
    add_usage_arguments(usage, site_help)

    model = commands.add_parser("model", help="create, import or verify model checkpoints (Hugging Face layout)")
    model_commands = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    tiny = model_commands.add_parser("create-tiny", help="write a small random Llama-3-style checkpoint (Hugging Face layout)")
    tiny.add_argument("dir")
    for flag, default in (("layers", 2), ("hidden", 64), ("heads", 4), ("kv-heads", 2), ("intermediate", 172),
                          ("max-position", 2048), ("seed", 0), ("shards", 2)):
        tiny.add_argument(f"--{flag}", type=int, default=default, help=f"default {default}")
    tiny.set_defaults(func=cmd_model_create_tiny)
    verify = model_commands.add_parser("verify", help="check every file of a checkpoint against its manifest")
    verify.add_argument("dir")
    verify.set_defaults(func=cmd_model_verify)
    imp = model_commands.add_parser(
        "import", help="copy a Hugging Face model directory into the model store with its checksum manifest",
        description="Check a Hugging Face model directory (config.json with model_type llama, mistral or qwen2; "
                    "safetensors weights of F32/F16/BF16; tokenizer.json) and copy it to STORE/NAME with the "
                    "manifest every weight tier verifies. Exit 2 on a refused or failed import.")
    imp.add_argument("src", metavar="SRC", help="the Hugging Face model directory (e.g. a huggingface-cli download)")
    imp.add_argument("--name", required=True, metavar="NAME",
                     help="directory name in the store: letters, digits, . _ -, optionally @VERSION for a rollout")
    where = imp.add_mutually_exclusive_group()
    where.add_argument("--site", help=site_help + "; the store is its weight_cache.l3_path")
    where.add_argument("--store", metavar="DIR", help="the store directory (instead of the site's l3_path)")
    imp.add_argument("--force", action="store_true", help="replace an existing STORE/NAME (atomically)")
    imp.set_defaults(func=cmd_model_import)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ["EXASERVE_LOG_LEVEL"] = args.log_level  # children (agent, replicas) inherit it
    os.environ["EXASERVE_LOG_FORMAT"] = args.log_format
    configure_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except ConfigError as exc:
        err.print(str(exc), highlight=False, markup=False)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
