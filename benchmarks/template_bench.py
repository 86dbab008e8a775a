"""Template builds through the real E2B SDK against `aenv server`, one run:

1. cold build: a small image (or ``--from-template base``) with three RUN steps,
   nothing cached (each round's steps differ);
2. cached rebuild: the same template again (every step and the snapshot reused);
3. last step changed: the first two steps cached, the third and the snapshot redone;
4. ``from_template``: a child of the built template with one RUN;
5. create → first command: ``Sandbox.create(built)`` + ``commands.run("true")`` vs
   the same from ``base``, interleaved round by round (the peer in this run).

    .venv/bin/python benchmarks/template_bench.py [--rounds 5] [--image REF] [--json]

Without ``--image`` the image is the test suite's musl + busybox image (no Python, no
bash) pushed into Debian's docker-registry on loopback; ``--from-template base``
builds from the base template instead. Targets (issue 14): an unchanged rebuild
≤ 2 s; create → first command from a built template ≤ 1.2× the same from base.
Numbers go to docs/benchmarks.md ("Template builds")."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info, percentile, print_table  # noqa: E402


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _image(tmp: Path) -> tuple[Any, str]:
    """The suite's small image in a registry process: (registry, reference)."""
    from tests.aenv_vm.oci.registryproc import Registry
    from tests.aenv_vm.builds.images import push_tiny_image   # the alpine-like image of the tests

    reg = Registry.start(tmp / "registry")
    return reg, push_tiny_image(reg, tmp / "layout")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--image", default=None, help="build from this image reference instead of the test image")
    ap.add_argument("--from-template", default=None, help="build from this template instead of an image")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from e2b import Sandbox, Template

    from tests.aenv_api.server.conftest import start_server

    tmp = Path(tempfile.mkdtemp(prefix="template-bench-"))
    registry = None
    srv = start_server(tmp / "node", tmp / "logs", env={"AENV_VM__POOL_SIZE": "0"})
    try:
        os.environ.update(srv.sdk_env())
        if args.from_template:
            base = ("template", args.from_template)
        elif args.image:
            base = ("image", args.image)
        else:
            registry, ref = _image(tmp)
            base = ("image", ref)

        def template(tag: str, last: str) -> Any:
            t = Template()
            t = t.from_template(base[1]) if base[0] == "template" else t.from_image(base[1])
            return (t.run_cmd(f"mkdir -p /home/user/bench && echo {tag} > /home/user/bench/one")
                     .run_cmd(f"echo {tag}-two > /home/user/bench/two")
                     .run_cmd(last))

        results: dict[str, list[float]] = {k: [] for k in ("cold", "cached", "last_changed", "from_template",
                                                             "create_built", "create_base")}
        for r in range(args.rounds):
            name = f"bench-{r}"
            results["cold"].append(_timed(lambda: Template.build(template(f"r{r}", "echo three > /home/user/bench/3"),
                                                                  name)))
            results["cached"].append(_timed(lambda: Template.build(template(f"r{r}", "echo three > /home/user/bench/3"),
                                                                    name)))
            results["last_changed"].append(_timed(lambda: Template.build(
                template(f"r{r}", f"echo changed-{r} > /home/user/bench/3"), name)))
            child = Template().from_template(name).run_cmd(f"echo child-{r} > /tmp/child")
            results["from_template"].append(_timed(lambda: Template.build(child, f"{name}-child")))
        def create_and_run(ref: str) -> float:
            t0 = time.perf_counter()
            sbx = Sandbox.create(ref)
            sbx.commands.run("true")
            took = time.perf_counter() - t0
            sbx.kill()
            return took
        # the first create of a template writes its memory image to the node's disk once
        first_create = create_and_run("bench-0")
        create_and_run("base")
        for r in range(args.rounds):
            for which, ref in (("create_built", "bench-0"), ("create_base", "base")):
                results[which].append(create_and_run(ref))
        p50 = {k: percentile(v, 50) for k, v in results.items()}
        ratio = p50["create_built"] / p50["create_base"]
        rows = [[k, f"{p50[k]:.2f}", f"{min(v):.2f}", f"{max(v):.2f}", len(v)] for k, v in results.items()]
        out = {"machine": machine_info(), "base": list(base), "rounds": args.rounds, "p50": p50,
               "samples": results, "create_ratio_built_vs_base": ratio, "first_create_of_a_template": first_create}
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            print(f"base: {base[0]} {base[1]}; {args.rounds} rounds; server pool 0 (every create restores)")
            print_table(rows, ["phase", "p50 s", "min s", "max s", "n"])
            print(f"first create of a new template (its memory image written to the node once): "
                  f"{first_create:.2f} s")
            print(f"create -> first command, built / base: {ratio:.2f}x (target <= 1.2x); "
                  f"unchanged rebuild p50 {p50['cached']:.2f} s (target <= 2 s)")
    finally:
        srv.stop()
        if registry is not None:
            registry.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
