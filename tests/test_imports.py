"""Importing dynaseq raises no deprecation warning, and the model code never imports torch.ao."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import dynaseq

SRC = Path(dynaseq.__file__).resolve().parent
#: packages that hold models and their building blocks: int8 goes through dynaseq.nn.int8
MODEL_PACKAGES = ("nn", "models", "adaptive", "branching", "techniques")


def test_import_raises_no_deprecation_warning():
    code = "import dynaseq, dynaseq.models, dynaseq.compress.int8"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_model_code_does_not_import_torch_ao():
    files = [f for pkg in MODEL_PACKAGES if (SRC / pkg).is_dir()
             for f in sorted((SRC / pkg).rglob("*.py"))]
    assert files
    bad = {str(f.relative_to(SRC)): name for f in files for name in _imports(f)
           if name == "torch.ao" or name.startswith("torch.ao.")}
    assert not bad, f"torch.ao imported in model code: {bad}"


def test_the_command_starts_without_torch():
    """``dynaseq --help``/``--version`` and argument errors answer without importing torch
    (0.1 s, not 1.6 s), and a Ctrl-C while the command starts is the one line
    ``dynaseq: interrupted``: before, it landed in torch's import, outside ``main``'s
    handler, as a traceback."""
    code = "import sys, dynaseq.cli; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr[-2000:]


def test_commands_outside_the_server_need_no_web_framework():
    """``profile --latency-table`` counts compute as the server does
    (:mod:`dynaseq.serve.compute`), on an install without the ``serve`` extra; ``serve``
    itself, without it, is one line naming the extra (before: tracebacks)."""
    code = ("import sys\n"
            "for m in ('pydantic', 'fastapi', 'uvicorn', 'prometheus_client'):\n"
            "    sys.modules[m] = None  # as if not installed\n"
            "import dynaseq.serve.compute, dynaseq.metrics.latency\n"
            "import importlib.util\n"
            "importlib.util.find_spec = lambda name, *a: None if name in ('fastapi',) else 1\n"
            "from dynaseq.cli import main\n"
            "sys.exit(main(['serve', sys.argv[1]]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    run = SRC / "workflows" / "demo_model"
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == ("dynaseq: error: serve needs the serve extra (missing fastapi): "
                                "pip install 'dynaseq[serve]'")
