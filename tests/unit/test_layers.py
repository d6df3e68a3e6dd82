"""The package's layering (docs/architecture.md "Layers"), enforced.

Two checks, both over every module of exaserve_hpc:
- import-linter's contracts in .importlinter (a module imports only from the layers below its own; grimp
  reads imports inside functions too, so a function-level import cannot hide an upward one);
- the only imports inside functions or classes are the optional third-party backends, which must not load
  where they are absent: tensorrt_llm, pyslurm, mpi4py, matplotlib. Everything else is imported at the top
  of its module, where a reader sees what the module depends on.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "exaserve_hpc"
OPTIONAL_BACKENDS = ("tensorrt_llm", "pyslurm", "mpi4py", "matplotlib")


def nested_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import statement not at a module's top level (a module-level `if`/`try` counts
    as top level: that is how an optional package is probed once)."""
    tree = ast.parse(source)
    found = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and nested:
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or "."]
                found.extend((child.lineno, name) for name in names)
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            visit(child, inner)

    visit(tree, False)
    return found


def test_the_checker_sees_imports_inside_functions_and_classes_but_not_module_level_probes():
    source = ("import os\ntry:\n    import pynvml\nexcept ImportError:\n    pynvml = None\n"
              "def f():\n    from exaserve_hpc.config import schema\n    if True:\n        import json\n"
              "class C:\n    import zmq\n")
    assert nested_imports(source) == [(7, "exaserve_hpc.config"), (9, "json"), (11, "zmq")]


def test_only_optional_backends_are_imported_inside_functions():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, module in nested_imports(path.read_text()):
            if module.split(".")[0] not in OPTIONAL_BACKENDS:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offenders, ("imports inside functions (move them to the module's top; only "
                           f"{', '.join(OPTIONAL_BACKENDS)} may load late):\n" + "\n".join(offenders))


def test_import_linter_contracts_hold():
    pytest.importorskip("importlinter")
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and "3 kept" in done.stdout


def test_a_contract_breach_is_reported(tmp_path):
    """The contract is not vacuous: the same layers with the composition root below the controller break."""
    pytest.importorskip("importlinter")
    config = (ROOT / ".importlinter").read_text()
    swapped = config.replace("    exaserve_hpc.app\n", "").replace("    exaserve_hpc.controller\n",
                                                                    "    exaserve_hpc.controller\n    exaserve_hpc.app\n")
    assert swapped != config
    (tmp_path / "swapped.ini").write_text(swapped)
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache", str(tmp_path / "swapped.ini")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "exaserve_hpc.app" in done.stdout


def test_every_site_setting_is_read_outside_the_schema():
    """The wiring check's second list, for the schema's new home (config/schema.py): a field nothing outside
    the schema reads is a setting the running system ignores. A field a config method (not a validator) reads
    counts as read: properties derive from it."""
    schema = PACKAGE / "config" / "schema.py"
    tree = ast.parse(schema.read_text())
    others = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p != schema)
    derived = {n.attr for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
               and "validator" not in " ".join(ast.unparse(d) for d in fn.decorator_list)
               for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
    fields = [(cls.name, stmt.target.id) for cls in tree.body if isinstance(cls, ast.ClassDef) for stmt in cls.body
              if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
              and not stmt.target.id.startswith("_") and stmt.target.id != "model_config"]
    assert len(fields) > 100  # the check looks at the real schema
    unread = [f"{cls}.{name}" for cls, name in fields
              if name not in derived and not re.search(rf"\.{name}\b|[\"']{name}[\"']", others)]
    assert not unread, f"settings nothing reads: {unread}"
