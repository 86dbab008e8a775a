"""envd runs in a guest that has python3 and nothing else: stdlib imports only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENVD = Path(__file__).resolve().parents[2] / "envd"


def test_envd_imports_only_the_standard_library() -> None:
    bad = []
    for path in sorted(ENVD.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "__future__" and top not in sys.stdlib_module_names:
                    bad.append(f"{path.name}: {name}")
    assert bad == []


def test_envd_starts_without_site_packages(tmp_path: Path) -> None:
    # -S -s -E: no site-packages, no user site, no PYTHONPATH -- like the bare guest.
    r = subprocess.run([sys.executable, "-S", "-s", "-E", "-c", "import envd.server, envd.__main__"],
                       cwd=ENVD.parent, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_bad_arguments_exit_cleanly() -> None:
    r = subprocess.run([sys.executable, "-m", "envd", "--port", "99999"], cwd=ENVD.parent,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid port" in r.stderr and "Traceback" not in r.stderr
