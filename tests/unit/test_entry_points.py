"""Every console script setup.cfg declares names a callable (an entry point naming a module, not a function,
installs an `exaserve` that fails at its first run), and `python -m` entry modules exist."""

from __future__ import annotations

import configparser
import importlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_console_scripts_name_functions():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = [line.split("=", 1) for line in config["options.entry_points"]["console_scripts"].splitlines() if line]
    assert [name.strip() for name, _ in scripts] == ["exaserve"]
    for _, target in scripts:
        module, _, attribute = target.strip().partition(":")
        assert callable(getattr(importlib.import_module(module), attribute)), target


def test_python_dash_m_entries_exist():
    for module in ("exaserve_hpc.cli.__main__", "exaserve_hpc.launcher.__main__", "exaserve_hpc.agent.__main__"):
        assert importlib.util.find_spec(module) is not None, module
