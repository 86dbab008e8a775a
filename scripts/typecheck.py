"""The type check of scripts/test.sh: mypy over the project's packages, held against
a baseline that may only shrink.

    .venv/bin/python scripts/typecheck.py            # check (exit 1 on a failure)
    .venv/bin/python scripts/typecheck.py --update   # also rewrite mypy-baseline.txt

What mypy checks and how is pyproject.toml's ``[tool.mypy]``; the packages are its
``packages`` list, of which those that exist are checked (a package listed before its
code lands is skipped). The check fails when

- a module under the strict overrides (the seams: ``disallow_untyped_defs = true``)
  has any error: those are never recorded;
- any other module has an error that mypy-baseline.txt does not list (a new error);
- mypy-baseline.txt lists an error that is gone: the baseline may only shrink, so its
  line is removed in the same change that fixed it (``--update`` does that).

A baseline line is ``path: [code] message`` without the line number, so that edits
elsewhere in a file do not churn it; the same error twice in a file is two equal lines
(compared as counts). ``--update`` rewrites the baseline only when nothing is new;
after a merge that moved code (the same errors under new paths), ``--update
--accept-new`` records what mypy reports now, to be reviewed in the diff like code.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE = REPO / "mypy-baseline.txt"
PYPROJECT = REPO / "pyproject.toml"
UPDATE_COMMAND = ".venv/bin/python scripts/typecheck.py --update"

HEADER = """\
# mypy's errors outside the strict modules, as of the last `scripts/typecheck.py --update`.
# One error per line, `path: [code] message` (no line numbers), sorted; an error found
# twice in a file is listed twice. The check fails on an error not listed here and on a
# line here whose error is gone: this file may only shrink (docs/development.md).
"""


@dataclass(frozen=True)
class MypyError:
    path: str           # relative to the repository, with /
    line: int
    code: str
    message: str

    @property
    def key(self) -> str:
        """The baseline line: the error without where in the file it is."""
        # a message naming another line ("already defined on line 12") would change with
        # every edit above that line
        message = re.sub(r"\bline \d+", "line N", self.message)
        return f"{self.path}: [{self.code}] {message}"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: error: {self.message}  [{self.code}]"


@dataclass(frozen=True)
class Config:
    packages: tuple[str, ...]           # the [tool.mypy] packages that exist
    missing: tuple[str, ...]            # listed but not (yet) in the tree
    strict_patterns: tuple[str, ...]    # module patterns of the strict overrides


def load_config(pyproject: Path = PYPROJECT, root: Path = REPO) -> Config:
    mypy = tomllib.loads(pyproject.read_text())["tool"]["mypy"]
    listed = tuple(mypy["packages"])
    present = tuple(p for p in listed if (root / p / "__init__.py").is_file())
    strict: list[str] = []
    for override in mypy.get("overrides", []):
        if override.get("disallow_untyped_defs"):
            modules = override["module"]
            strict.extend([modules] if isinstance(modules, str) else modules)
    return Config(present, tuple(p for p in listed if p not in present), tuple(strict))


def module_of(path: str) -> str:
    """``aenv_store/cache/__init__.py`` -> ``aenv_store.cache``."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def matches(module: str, pattern: str) -> bool:
    """mypy's override patterns: ``a.b.*`` is ``a.b`` and everything under it."""
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return module == base or module.startswith(base + ".")
    return module == pattern


def is_strict(path: str, patterns: Iterable[str]) -> bool:
    module = module_of(path)
    return any(matches(module, p) for p in patterns)


def parse_mypy_json(lines: Iterable[str]) -> list[MypyError]:
    """mypy's ``-O json`` output (one object a line); notes are not errors."""
    errors = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        item = json.loads(line)
        if item.get("severity") != "error":
            continue
        errors.append(MypyError(str(item["file"]).replace("\\", "/"), int(item["line"]),
                                str(item.get("code") or "misc"), str(item["message"])))
    return errors


def read_baseline(text: str) -> collections.Counter[str]:
    return collections.Counter(
        line for line in text.splitlines() if line.strip() and not line.startswith("#"))


def render_baseline(errors: Iterable[MypyError]) -> str:
    return HEADER + "".join(f"{k}\n" for k in sorted(e.key for e in errors))


@dataclass(frozen=True)
class Verdict:
    strict: tuple[MypyError, ...]   # errors in strict modules: always a failure
    new: tuple[MypyError, ...]      # errors elsewhere that the baseline does not list
    gone: tuple[str, ...]           # baseline lines whose error mypy no longer reports
    recorded: tuple[MypyError, ...] # the errors outside the strict modules

    @property
    def ok(self) -> bool:
        return not (self.strict or self.new or self.gone)


def judge(errors: Sequence[MypyError], baseline: collections.Counter[str],
          strict_patterns: Sequence[str]) -> Verdict:
    ordered = sorted(errors, key=lambda e: (e.path, e.line))
    strict = tuple(e for e in ordered if is_strict(e.path, strict_patterns))
    others = tuple(e for e in ordered if not is_strict(e.path, strict_patterns))
    allowed = collections.Counter(baseline)
    new = []
    for e in others:    # of N+1 errors where the baseline has N, the last one is new
        if allowed[e.key] > 0:
            allowed[e.key] -= 1
        else:
            new.append(e)
    gone = tuple(sorted(allowed.elements()))
    return Verdict(strict, tuple(new), gone, others)


def run_mypy(packages: Sequence[str]) -> tuple[int, list[str], str]:
    cmd = [sys.executable, "-m", "mypy", "-O", "json", "--no-error-summary"]
    for p in packages:
        cmd += ["-p", p]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def report(verdict: Verdict, out: list[str]) -> None:
    if verdict.strict:
        out.append(f"type check: {len(verdict.strict)} error(s) in strict modules "
                   "(never baselined: fix them):")
        out.extend(f"  {e}" for e in verdict.strict)
    if verdict.new:
        out.append(f"type check: {len(verdict.new)} new error(s), not in "
                   f"{BASELINE.name} (fix them):")
        out.extend(f"  {e}" for e in verdict.new)
    if verdict.gone:
        out.append(f"type check: {len(verdict.gone)} error(s) in {BASELINE.name} are gone; "
                   f"the baseline may only shrink: remove these lines (or run "
                   f"`{UPDATE_COMMAND}`):")
        out.extend(f"  {line}" for line in verdict.gone)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--update", action="store_true",
                    help=f"rewrite {BASELINE.name} (only when no error is new)")
    ap.add_argument("--accept-new", action="store_true",
                    help="with --update: record new errors outside the strict modules too "
                         "(after a merge that moved code; review the diff)")
    args = ap.parse_args(argv)
    if args.accept_new and not args.update:
        ap.error("--accept-new goes with --update")

    config = load_config()
    rc, stdout, stderr = run_mypy(config.packages)
    errors = parse_mypy_json(stdout)
    if rc not in (0, 1) or (rc == 1 and not errors):
        # mypy itself failed (a bad config, a package it cannot find, a crash)
        sys.stderr.write("\n".join(stdout) + "\n" + stderr)
        print(f"type check: mypy failed (exit {rc})", file=sys.stderr)
        return 1
    baseline_text = BASELINE.read_text() if BASELINE.exists() else ""
    verdict = judge(errors, read_baseline(baseline_text), config.strict_patterns)
    skipped = f", not yet present: {', '.join(config.missing)}" if config.missing else ""
    checked = f"{', '.join(config.packages)}{skipped}"

    out: list[str] = []
    if args.update:
        if verdict.strict or (verdict.new and not args.accept_new):
            report(Verdict(verdict.strict, verdict.new, (), ()), out)
            out.append(f"type check: {BASELINE.name} not updated: new errors are fixed, "
                       "not recorded")
            print("\n".join(out), file=sys.stderr)
            return 1
        text = render_baseline(verdict.recorded)
        if text == baseline_text:
            print(f"type check: {BASELINE.name} is up to date: {len(verdict.recorded)} error(s) "
                  f"[{checked}]")
            return 0
        BASELINE.write_text(text)
        print(f"type check: {BASELINE.name} updated: {len(verdict.recorded)} error(s) "
              f"({len(verdict.gone)} gone, {len(verdict.new)} new) [{checked}]")
        return 0
    report(verdict, out)
    if out:
        print("\n".join(out), file=sys.stderr)
        return 1
    print(f"type check: ok: no error in the strict modules, {len(verdict.recorded)} "
          f"baselined elsewhere [{checked}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
