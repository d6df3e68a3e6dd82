"""`exaserve modules install DIR [--site SITE] [--prefix PREFIX]`: publish this install as an environment module.

Copies the modulefiles (Lmod's exaserve/VERSION.lua and the Tcl exaserve/VERSION) into DIR and writes
DIR/exaserve.conf beside them: the install's prefix (this Python's environment), the default site
config, where site configs are looked up, and one `prereq=` line per module the site names
(cluster.modules). A shipped site (`--site NAME`) is copied with the others into DIR/site-configs/, an
editable copy outside the install, and the module points there. Then: `module use DIR && module load exaserve`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from exaserve_hpc import __version__
from exaserve_hpc.config.schema import load_site, resolve_site
from exaserve_hpc.resources import data_path


def write_modulefiles(target: Path, site_file: Path, prefix: Path) -> list[Path]:
    site = load_site(site_file)
    source = data_path("modules") / "exaserve"
    (target / "exaserve").mkdir(parents=True, exist_ok=True)
    written = []
    for name in (__version__, f"{__version__}.lua"):
        if not (source / name).exists():
            raise FileNotFoundError(f"no modulefile {source / name} for version {__version__} in this install")
        written.append(Path(shutil.copy(source / name, target / "exaserve" / name)))
    site_file = Path(site_file).resolve()
    shipped = data_path("site-configs").resolve()
    if site_file.parent == shipped:
        # A shipped site named by --site NAME lives inside this install (site-packages, replaced by the next
        # upgrade): the module points at an editable copy beside the modulefiles instead, with the other
        # shipped sites, so `--site NAME` keeps working.
        copies = target / "site-configs"
        copies.mkdir(parents=True, exist_ok=True)
        for shipped_site in shipped.glob("*.y*ml"):
            if not (copies / shipped_site.name).exists():  # a centre's edits are never overwritten
                shutil.copy(shipped_site, copies / shipped_site.name)
        site_file = copies / site_file.name
    readme = data_path("README.md")
    lines = [f"prefix={prefix}", f"site={site_file}", f"site_dir={site_file.parent}",
             *([f"url={readme}"] if readme.exists() else []), *(f"prereq={m}" for m in site.cluster.modules)]
    conf = target / "exaserve.conf"
    conf.write_text("# written by `exaserve modules install`; read by the exaserve modulefiles beside it\n"
                    + "\n".join(lines) + "\n")
    return [*written, conf]


def add_modules_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="modules_command", metavar="ACTION", required=True)
    install = actions.add_parser("install", help="copy the modulefiles into DIR and write DIR/exaserve.conf")
    install.add_argument("dir", metavar="DIR", help="a directory for `module use` (created if missing)")
    install.add_argument("--site", help="the default site config (name or YAML path); its cluster.modules "
                                        "become the module's prerequisites")
    install.add_argument("--prefix", default=sys.prefix, help=f"the install to activate (default: {sys.prefix})")
    install.set_defaults(func=cmd_modules_install)


def cmd_modules_install(args: argparse.Namespace) -> int:
    target = Path(args.dir).expanduser().resolve()
    for path in write_modulefiles(target, resolve_site(args.site), Path(args.prefix).resolve()):
        print(f"wrote {path}")
    print(f"use it with: module use {target} && module load exaserve/{__version__}")
    return 0
