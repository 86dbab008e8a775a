"""Run the E2B SDK's core flows against an aenv server with each of several SDK
versions, and print one line per version × flow.

    aenv server ...            # prints the E2B_* variables: export them
    python scripts/sdk_range/run.py [VERSION ...] [--js] [--cache DIR]

Python (flows.py): each version in its own venv; ``--js`` (flows.mjs): the npm SDK, each
version in its own npm prefix; ``--ci`` (flows_ci.py): the code-interpreter SDK
(``e2b-code-interpreter``, with the ``e2b`` of its day), on the node's own
``code-interpreter-v1``. Both are made under ``--cache`` (default
``~/.cache/aenv-sdk-range``), outside the repository, once per version. With no
version given, the spread docs/conformance.md reports is run. Exit status 1 if any
flow failed (NONE, a call the version lacks, is not a failure).

``--hosts CERT``: the node serves ``https://<port>-<id>.<E2B_DOMAIN>``
([server] domain, tls_cert = CERT, tls_port 443: what SDKs that ignore
``E2B_SANDBOX_URL`` call); in the flows' processes names under ``E2B_DOMAIN`` resolve
to 127.0.0.1, as a wildcard DNS record pointing at the node would
(scripts/e2b_conformance/sitecustomize.py; for node, scripts/e2b_js_conformance/
resolve-local.cjs), and CERT is trusted (``SSL_CERT_FILE``; ``NODE_EXTRA_CA_CERTS``)."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESOLVER = HERE.parent / "e2b_conformance"      # its sitecustomize.py: the wildcard name, locally
JS_RESOLVER = HERE.parent / "e2b_js_conformance" / "resolve-local.cjs"      # the same for node
DEFAULT_JS_VERSIONS = ("2.0.1", "2.5.0", "2.9.1", "2.15.0", "2.25.0", "2.35.0", "2.51.0")
DEFAULT_CI_VERSIONS = ("2.4.0", "2.6.0", "2.8.0", "2.10.0", "2.11.5")
DEFAULT_VERSIONS = ("2.0.0", "2.3.0", "2.5.0", "2.10.0", "2.15.0", "2.20.0", "2.26.0", "2.30.0", "2.45.0",
                    "2.63.0")


def contemporary_e2b(version: str) -> str:
    """The newest ``e2b`` released before ``e2b-code-interpreter==version``: what its
    users got when they pinned it (its range, ``e2b>=2,<3``, admits today's e2b, which
    older code-interpreter SDKs cannot drive: their transports differ)."""
    def releases(package: str) -> dict[str, str]:
        with urllib.request.urlopen(f"https://pypi.org/pypi/{package}/json", timeout=60) as r:
            data = json.load(r)
        return {v: min(f["upload_time_iso_8601"] for f in files) for v, files in data["releases"].items()
                if files and re.fullmatch(r"[0-9.]+", v)}
    released = releases("e2b-code-interpreter")[version]
    core = sorted((t, v) for v, t in releases("e2b").items() if t <= released)
    return core[-1][1]


def sdk_python(cache: Path, version: str, package: str = "e2b") -> Path:
    """The Python of a venv holding ``package==version`` (made on first use); the
    code-interpreter SDK with its contemporary ``e2b``."""
    d = cache / f"{package}-{version}"
    py = d / "bin" / "python"
    if not (d / ".installed").exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(d)
        extra = [f"e2b=={contemporary_e2b(version)}"] if package == "e2b-code-interpreter" else []
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"{package}=={version}", *extra], check=True)
        (d / ".installed").write_text(version)
    return py


def sdk_node_dir(cache: Path, version: str) -> Path:
    """A directory holding ``e2b@version`` from npm and flows.mjs (made on first use)."""
    d = cache / f"e2b-js-{version}"
    if not (d / ".installed").exists():
        d.mkdir(parents=True, exist_ok=True)
        (d / "package.json").write_text('{"private": true, "type": "module"}\n')
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", f"e2b@{version}"], cwd=d,
                       check=True, stdout=subprocess.DEVNULL)
        (d / ".installed").write_text(version)
    (d / "flows.mjs").write_bytes((HERE / "flows.mjs").read_bytes())
    return d


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="*")
    p.add_argument("--js", action="store_true", help="the npm SDK (flows.mjs) instead of the Python one")
    p.add_argument("--ci", action="store_true", help="the code-interpreter SDK (flows_ci.py)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "aenv-sdk-range")
    p.add_argument("--hosts", type=Path, metavar="CERT",
                   help="host names over TLS: E2B_DOMAIN resolves to this machine, CERT (the node's) is trusted")
    args = p.parse_args()
    missing = [v for v in ("E2B_API_KEY", "E2B_API_URL") if not os.environ.get(v)]
    if args.hosts is not None and not os.environ.get("E2B_DOMAIN"):
        missing.append("E2B_DOMAIN")
    if missing:
        print(f"sdk_range: set {', '.join(missing)} (what `aenv server` prints)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.hosts is not None:
        cert = str(args.hosts.resolve())
        env.update(AENV_CONFORMANCE_LOCAL_DOMAIN=env["E2B_DOMAIN"], SSL_CERT_FILE=cert,
                   PYTHONPATH=os.pathsep.join(p for p in (str(RESOLVER), env.get("PYTHONPATH", "")) if p),
                   AENV_JS_CONFORMANCE_LOCAL_DOMAIN=env["E2B_DOMAIN"], NODE_EXTRA_CA_CERTS=cert,
                   NODE_OPTIONS=f"{env.get('NODE_OPTIONS', '')} --require {JS_RESOLVER}".strip())
    args.cache.mkdir(parents=True, exist_ok=True)
    failed = False
    defaults = DEFAULT_JS_VERSIONS if args.js else DEFAULT_CI_VERSIONS if args.ci else DEFAULT_VERSIONS
    for version in args.versions or defaults:
        try:
            if args.js:
                d = sdk_node_dir(args.cache, version)
                argv, cwd = ["node", "flows.mjs"], d
            elif args.ci:
                argv, cwd = [str(sdk_python(args.cache, version, "e2b-code-interpreter")),
                             str(HERE / "flows_ci.py")], HERE
            else:
                argv, cwd = [str(sdk_python(args.cache, version)), str(HERE / "flows.py")], HERE
        except subprocess.CalledProcessError as e:
            print(f"{version}\t(install)\tFAIL\t{e.cmd[0]} exited {e.returncode}", flush=True)
            failed = True
            continue
        done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=1800)
        lines = [line for line in done.stdout.splitlines() if line.startswith(version + "\t")]
        for line in lines:
            print(line, flush=True)
        if done.returncode != 0 or not lines:
            failed = True
            if not lines:
                print(f"{version}\t(run)\tFAIL\t{done.stdout.strip()[-300:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
