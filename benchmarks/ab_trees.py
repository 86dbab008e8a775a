"""One benchmark, two source trees, back to back in one run: before/after figures.

    .venv/bin/python benchmarks/ab_trees.py --before ../aenv-before --after . [--rounds 3]
        [--metrics REGEX] [--guest-cache DIR] [--stdout-json] [--keep DIR] -- snapshot_bench.py --fork 16 ...
    .venv/bin/python benchmarks/ab_trees.py --report DIR [--metrics REGEX]    # the table of a kept run

Each round runs ``benchmarks/<BENCH>`` of both trees, the order alternating (A B, B A,
...) so a drift of the machine over the run (page cache, ksmd, thermal) falls on both
sides. Every run uses this interpreter (so both trees get the same packages) with
``PYTHONPATH`` set to its tree, so the benchmark and every server or node it starts
import that tree's code. Trees whose guests differ (envd's sources changed) get a guest
cache each under ``--guest-cache`` (``AENV_GUEST_CACHE``), so the two do not rebuild
each other's guest image.

The benchmark writes its results as JSON (``--json FILE`` is appended, or with
``--stdout-json`` the last JSON object it prints is taken). Every numeric leaf of that
JSON is a metric; a list of numbers counts as its median, a list of objects (one per
sample) as each field's median over the samples. The table shows, per metric,
the median over rounds for each tree, the ratio after/before, and the spread of the
before rounds (min..max), which is the noise an "after" figure is judged against.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Tree:
    label: str
    root: Path
    rounds: list[dict[str, float]] = field(default_factory=list)


def flatten(obj: object, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value by dotted path. A list of numbers is its median; a
    list of objects (one per sample: a create, a resume) is each path's median over the
    samples that have it (``path[*].field``)."""
    out: dict[str, float] = {}
    if isinstance(obj, bool):
        return out
    if isinstance(obj, (int, float)):
        out[prefix] = float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list):
        nums = [x for x in obj if isinstance(x, (int, float)) and not isinstance(x, bool)]
        if nums and len(nums) == len(obj):
            out[prefix] = float(statistics.median(nums))
        elif obj and all(isinstance(x, dict) for x in obj):
            samples: dict[str, list[float]] = {}
            for x in obj:
                for k, v in flatten(x, f"{prefix}[*]").items():
                    samples.setdefault(k, []).append(v)
            out.update({k: float(statistics.median(v)) for k, v in samples.items()})
        else:
            for i, v in enumerate(obj):
                out.update(flatten(v, f"{prefix}[{i}]"))
    return out


def last_json_object(text: str) -> object:
    """The last top-level JSON object printed in ``text``."""
    decoder = json.JSONDecoder()
    found: object = None
    i = 0
    while (start := text.find("{", i)) != -1:
        try:
            found, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        i = end
    if found is None:
        raise ValueError("the benchmark printed no JSON object")
    return found


def run_once(tree: Tree, bench: list[str], stdout_json: bool, guest_cache: Path | None,
             work: Path, n: int) -> dict[str, float]:
    script = tree.root / "benchmarks" / bench[0]
    if not script.is_file():
        raise SystemExit(f"{script} does not exist")
    env = dict(os.environ, PYTHONPATH=str(tree.root))
    if guest_cache is not None:
        env["AENV_GUEST_CACHE"] = str(guest_cache / tree.label)
    cmd = [sys.executable, str(script), *bench[1:]]
    out_path = work / f"{tree.label}-{n}.json"
    if not stdout_json:
        cmd += ["--json", str(out_path)]
    print(f"[round {n}] {tree.label}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=tree.root, env=env, stdout=subprocess.PIPE, text=True)
    (work / f"{tree.label}-{n}.out").write_text(proc.stdout)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-4000:])
        raise SystemExit(f"{tree.label} round {n} failed with exit status {proc.returncode}")
    data = last_json_object(proc.stdout) if stdout_json else json.loads(out_path.read_text())
    return flatten(data)


def table(a: Tree, b: Tree, pattern: re.Pattern[str]) -> str:
    keys = sorted(k for k in set().union(*a.rounds, *b.rounds) if pattern.search(k))
    lines = [f"| metric | {a.label} p50 | {b.label} p50 | {b.label}/{a.label} | {a.label} rounds min..max |",
             "|---|---:|---:|---:|---|"]
    for k in keys:
        av = [r[k] for r in a.rounds if k in r]
        bv = [r[k] for r in b.rounds if k in r]
        if not av or not bv:
            continue
        am, bm = statistics.median(av), statistics.median(bv)
        ratio = f"{bm / am:.2f}" if am else "-"
        lines.append(f"| {k} | {am:.4g} | {bm:.4g} | {ratio} | {min(av):.4g}..{max(av):.4g} |")
    return "\n".join(lines)


def report(kept: Path, labels: list[str], pattern: re.Pattern[str]) -> int:
    """The table of a kept run: ``<label>-<round>.json``, else the last JSON object of
    ``<label>-<round>.out`` (a benchmark that printed its JSON)."""
    trees = [Tree(label, kept) for label in labels]
    for tree in trees:
        n = 0
        while True:
            js, out = kept / f"{tree.label}-{n}.json", kept / f"{tree.label}-{n}.out"
            if js.is_file():
                tree.rounds.append(flatten(json.loads(js.read_text())))
            elif out.is_file():
                tree.rounds.append(flatten(last_json_object(out.read_text())))
            else:
                break
            n += 1
        if not tree.rounds:
            raise SystemExit(f"no rounds of {tree.label!r} kept in {kept}")
    print(table(trees[0], trees[1], pattern))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="the tree measured first in round 0")
    ap.add_argument("--after", type=Path)
    ap.add_argument("--labels", nargs=2, default=["before", "after"], metavar=("A", "B"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--metrics", default="", help="only metrics whose path matches this regex")
    ap.add_argument("--guest-cache", type=Path, default=None,
                    help="a guest cache per tree under this directory (AENV_GUEST_CACHE)")
    ap.add_argument("--stdout-json", action="store_true",
                    help="the benchmark prints its JSON (template_bench.py --json) instead of writing --json FILE")
    ap.add_argument("--keep", type=Path, default=None, help="keep every round's JSON and output here")
    ap.add_argument("--report", type=Path, default=None,
                    help="no runs: the table of the rounds kept in this directory (--keep of an earlier run)")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- BENCH.py [its arguments]")
    args = ap.parse_args()
    try:
        pattern = re.compile(args.metrics)
    except re.error as e:
        ap.error(f"--metrics: {e}")
    if args.report is not None:
        return report(args.report, args.labels, pattern)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if args.before is None or args.after is None:
        ap.error("name both trees: --before DIR --after DIR (or --report DIR)")
    if not bench:
        ap.error("name the benchmark after --, e.g. -- snapshot_bench.py --fork 16")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    a = Tree(args.labels[0], args.before.resolve())
    b = Tree(args.labels[1], args.after.resolve())
    work = args.keep or Path(tempfile.mkdtemp(prefix="aenv-ab-"))
    work.mkdir(parents=True, exist_ok=True)
    for n in range(args.rounds):
        for tree in ((a, b) if n % 2 == 0 else (b, a)):
            tree.rounds.append(run_once(tree, bench, args.stdout_json, args.guest_cache, work, n))
    print(f"\n{' '.join(bench)}; {args.rounds} rounds, alternating; raw results in {work}\n")
    print(table(a, b, pattern))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
