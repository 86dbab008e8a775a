"""The ``code-interpreter-v1`` template as the e2b SDK's Template builder makes it
(docs/code-interpreter.md): base (which has Debian's Jupyter and data packages since
the guest build installs them), the ``codeint`` server, started and warmed before the
snapshot. Used by the tests and the benchmark."""
from __future__ import annotations

from pathlib import Path

from e2b import Template

REPO = Path(__file__).resolve().parents[2]
NAME = "code-interpreter-v1"
START = "cd /opt/aenv && exec python3 -m codeint --log-dir /tmp/codeint"
READY = ("python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:49999/health', timeout=5)\"")


def code_interpreter_template() -> Template:
    return (Template(file_context_path=str(REPO))
            .from_template("base")
            .set_user("root")
            .copy("codeint", "/opt/aenv/codeint/")
            .set_user("user")
            .set_workdir("/home/user")
            .set_start_cmd(START, READY))
