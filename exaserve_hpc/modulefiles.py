"""`exaserve modules install DIR [--site SITE] [--prefix PREFIX]`: publish this install as an environment module.

Copies the modulefiles (Lmod's exaserve/VERSION.lua and the Tcl exaserve/VERSION) into DIR and writes
DIR/exaserve.conf beside them: the install's prefix (this Python's environment), the default site
config, where site configs are looked up, and one `prereq=` line per module the site names
(cluster.modules). Then: `module use DIR && module load exaserve`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from . import __version__
from .config import load_site, resolve_site
from .resources import data_path


def write_modulefiles(target: Path, site_file: Path, prefix: Path) -> list[Path]:
    site = load_site(site_file)
    source = data_path("modules") / "exaserve"
    (target / "exaserve").mkdir(parents=True, exist_ok=True)
    written = []
    for name in (__version__, f"{__version__}.lua"):
        if not (source / name).exists():
            raise FileNotFoundError(f"no modulefile {source / name} for version {__version__} in this install")
        written.append(Path(shutil.copy(source / name, target / "exaserve" / name)))
    readme = data_path("README.md")
    lines = [f"prefix={prefix}", f"site={Path(site_file).resolve()}", f"site_dir={Path(site_file).resolve().parent}",
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
