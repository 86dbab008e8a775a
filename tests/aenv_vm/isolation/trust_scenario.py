"""Runs inside the node's network namespace (test_base_trust.py starts it there) with
the E2B SDK pointed at the node under test: one sandbox from ``base`` runs what agents
run and reaches the test's HTTPS host, whose certificate only the test's CA vouches
for. Prints ``{check: {"exit": code, "out": stdout tail, "err": stderr tail}}`` as JSON.

    python -m tests.aenv_vm.isolation.trust_scenario URL full|tls|build
"""
from __future__ import annotations

import json
import sys

from e2b import CommandExitException, Sandbox

TOOLS = {
    "python": "python --version",
    "pip": "pip --version",
    "venv": "python -m venv /tmp/venv && /tmp/venv/bin/python -c 'import sys; print(sys.prefix)'",
    "git": "git --version",
    "node": "node --version",
    "npm": "npm --version",
    "gcc": "gcc --version | head -1 && printf 'int main(void){return 0;}' > /tmp/t.c && gcc -o /tmp/t /tmp/t.c && /tmp/t",
    "make": "make --version | head -1",
    "jq": "echo '{\"a\": 7}' | jq .a",
    "unzip": "unzip -v | head -1",
    "sudo": "sudo -n true && sudo -n id -u",
    "wget_version": "wget --version | head -1",
    "curl_version": "curl --version | head -1",
    "less": "less --version | head -1",
    "ps": "ps -o pid= -p $$",
    "ip": "ip -br link show lo",
}


def tls(url: str) -> dict[str, str]:
    """What needs the CA: curl, wget, git's HTTPS, Python's and Node's TLS, pip from an index."""
    return {
        "curl": f"curl -sS --max-time 20 {url}/",
        "wget": f"wget -q -T 20 -O - {url}/",
        "python_tls": f"python -c \"import urllib.request; print(urllib.request.urlopen('{url}/', timeout=20)"
                      f".read().decode().strip())\"",
        "node_tls": "node -e \"require('https').get('" + url + "/', r => { let b=''; r.on('data', d => b += d); "
                    "r.on('end', () => console.log(b.trim())); }).on('error', e => { console.error(e.message); "
                    "process.exit(1); })\"",
        "pip_install": f"pip install --no-cache-dir --index-url {url}/simple/ aenv-hello && "
                       "python -c 'import aenv_hello; print(aenv_hello.GREETING)'",
    }


def apt(url: str) -> str:
    """apt over HTTPS from the test's flat repository (root, only that source)."""
    return (f"echo 'deb [trusted=yes] {url}/apt ./' > /etc/apt/sources.list.d/aenv-test.list && "
            "apt-get -q -o Dir::Etc::SourceList=/etc/apt/sources.list.d/aenv-test.list "
            "-o Dir::Etc::SourceParts=- update && "
            "apt-get -q -y -o Dir::Etc::SourceList=/etc/apt/sources.list.d/aenv-test.list "
            "-o Dir::Etc::SourceParts=- install aenv-hello && cat /usr/share/aenv-hello/hello.txt")


def run(sbx: Sandbox, cmd: str, user: str = "user") -> dict[str, object]:
    try:
        r = sbx.commands.run(cmd, user=user, timeout=300)  # type: ignore[arg-type]
        return {"exit": r.exit_code, "out": r.stdout[-2000:], "err": r.stderr[-2000:]}
    except CommandExitException as e:
        return {"exit": e.exit_code, "out": e.stdout[-2000:], "err": e.stderr[-2000:]}


def build(url: str) -> dict[str, object]:
    """A template build (issue 14, acceptance 2) whose steps are the SDK's apt_install and
    pip_install, fetched over HTTPS from the test's repository and index: the build VM
    trusts the node's CA bundle too. What a sandbox of the template then has."""
    from e2b import Template

    t = (Template().from_template("base")
         .set_user("root")
         # only the test's repository: the sealed network has no Debian mirror
         .run_cmd(f"mkdir -p /etc/apt/off && mv /etc/apt/sources.list* /etc/apt/off/ 2>/dev/null; "
                  f"echo 'deb [trusted=yes] {url}/apt ./' > /etc/apt/sources.list")
         .set_user("user")
         .set_envs({"PIP_INDEX_URL": f"{url}/simple/"})
         .apt_install(["aenv-hello"])
         .pip_install(["aenv-hello"]))
    lines: list[str] = []
    Template.build(t, "trust-build", on_build_logs=lambda e: lines.append(e.message))
    sbx = Sandbox.create("trust-build", timeout=900)
    try:
        return {"deb": run(sbx, "cat /usr/share/aenv-hello/hello.txt"),
                "wheel": run(sbx, "python -c 'import aenv_hello; print(aenv_hello.GREETING)'"),
                "log": {"exit": 0, "out": "\n".join(lines[-200:]), "err": ""}}
    finally:
        sbx.kill()


def main(url: str, what: str) -> None:
    if what == "build":
        print(json.dumps(build(url)), flush=True)
        return
    sbx = Sandbox.create(timeout=900)
    try:
        out: dict[str, object] = {}
        checks = {**(TOOLS if what == "full" else {}), **tls(url)}
        for name, cmd in checks.items():
            out[name] = run(sbx, cmd)
        if what == "full":
            out["apt"] = run(sbx, apt(url), user="root")
        out["env"] = run(sbx, "echo $NODE_EXTRA_CA_CERTS")
    finally:
        sbx.kill()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
