"""The type check's rules that need no mypy run (scripts/typecheck.py runs mypy itself,
before pytest, in scripts/test.sh):

* Every ``# type: ignore`` in the project's packages names the error it silences
  (``# type: ignore[code]``) and says why, on the same line (``# type: ignore[code]  #
  why``) or in a comment on the line above. Files from before this rule are in
  ``UNEXPLAINED_ALLOWED`` with how many of their ignores say no why: that list may only
  shrink. (mypy's ``warn_unused_ignores`` fails the ones that silence nothing.) No module
  changes mypy's settings for itself (``# mypy:`` comments, ``@no_type_check``).
* The baseline (mypy-baseline.txt) is well-formed, and scripts/typecheck.py judges a run
  against it as documented: a new error fails, a gone one fails, one in a strict module
  always fails.
"""
from __future__ import annotations

import collections
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import REPO


def _load_typecheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("aenv_typecheck", REPO / "scripts" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


typecheck = _load_typecheck()

# Files whose ignores predate the rule, with how many of them say no why. Lower a number
# (or drop the file) when you explain or remove one; never raise it.
UNEXPLAINED_ALLOWED: dict[str, int] = {}     # empty: every ignore says why (keep it so)

_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")


class Ignore:
    def __init__(self, line: int, has_code: bool, has_reason: bool) -> None:
        self.line, self.has_code, self.has_reason = line, has_code, has_reason


def find_ignores(source: str) -> list[Ignore]:
    """The ``# type: ignore`` comments of ``source`` (comments only: not in strings)."""
    lines = source.splitlines()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        m = _IGNORE.search(tok.string)
        if m is None:
            continue
        row = tok.start[0]
        has_code = bool(m["codes"]) and m["codes"].strip("[] ") != ""
        same_line = re.match(r"\s*#\s*\S", m["rest"]) is not None
        above = lines[row - 2].strip() if row >= 2 else ""
        line_above = above.startswith("#") and _IGNORE.search(above) is None and len(above.lstrip("# ")) > 0
        found.append(Ignore(row, has_code, same_line or line_above))
    return found


def project_files() -> list[Path]:
    config = typecheck.load_config()
    return [p for pkg in config.packages for p in sorted((REPO / pkg).rglob("*.py"))]


@pytest.mark.parametrize("source, has_code, has_reason", [
    ("x = f()  # type: ignore\n", False, False),
    ("x = f()  # type: ignore[]  # why\n", False, True),
    ("x = f()  # type: ignore[attr-defined]\n", True, False),
    ("x = f()  # type: ignore[attr-defined]  # f is patched in at import\n", True, True),
    ("x = f()  # type: ignore[attr-defined, misc]  #  \n", True, False),
    ("# f is patched in at import\nx = f()  # type: ignore[attr-defined]\n", True, True),
    ("y = 1  # not a reason: code\nx = f()  # type: ignore[attr-defined]\n", True, False),
    ("#\nx = f()  # type: ignore[attr-defined]\n", True, False),
    ("# type: ignore[misc]\nx = f()  # type: ignore[attr-defined]\n", True, False),
])
def test_ignore_scanner(source: str, has_code: bool, has_reason: bool) -> None:
    ignore = find_ignores(source)[-1]
    assert (ignore.has_code, ignore.has_reason) == (has_code, has_reason)


def test_ignore_scanner_skips_strings() -> None:
    assert find_ignores('s = "# type: ignore"\nt = """\n# type: ignore[misc]\n"""\n') == []


def test_every_type_ignore_names_its_error_and_says_why() -> None:
    no_code: list[str] = []
    unexplained: collections.Counter[str] = collections.Counter()
    for path in project_files():
        rel = path.relative_to(REPO).as_posix()
        for ignore in find_ignores(path.read_text()):
            if not ignore.has_code:
                no_code.append(f"{rel}:{ignore.line}")
            elif not ignore.has_reason:
                unexplained[rel] += 1
    assert not no_code, (f"a `# type: ignore` must name the error it silences "
                         f"(`# type: ignore[code]  # why`): {no_code}")
    problems = []
    for rel, n in sorted(unexplained.items()):
        allowed = UNEXPLAINED_ALLOWED.get(rel, 0)
        if n > allowed:
            problems.append(f"{rel}: {n} `# type: ignore` without a why ({allowed} allowed): say why on "
                            "the same line (`# type: ignore[code]  # why`) or in a comment above")
    for rel, allowed in sorted(UNEXPLAINED_ALLOWED.items()):
        n = unexplained.get(rel, 0)
        if n < allowed:
            problems.append(f"{rel}: {n} unexplained `# type: ignore` now, the allow-list says {allowed}: "
                            f"the list may only shrink, lower it to {n}" + (" (drop the entry)" if n == 0 else ""))
    assert not problems, "\n".join(problems)


def test_no_module_turns_the_checker_off() -> None:
    """Inline configuration (``# mypy: ignore-errors``, ``disable-error-code``, a strict flag
    turned off) and ``@no_type_check`` would change the rules of one module out of sight of
    pyproject.toml."""
    found = []
    for path in project_files():
        source = path.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT and re.match(r"#\s*mypy\s*:", tok.string):
                found.append(f"{path.relative_to(REPO)}:{tok.start[0]}: {tok.string}")
            elif tok.type == tokenize.NAME and tok.string == "no_type_check":
                found.append(f"{path.relative_to(REPO)}:{tok.start[0]}: no_type_check")
    assert not found, "mypy's settings live in pyproject.toml's [tool.mypy]: " + "; ".join(found)


# -- the baseline ----------------------------------------------------------------------

def test_config_lists_the_packages_and_the_strict_seams() -> None:
    config = typecheck.load_config()
    listed = set(config.packages) | set(config.missing)
    assert {"aenv_store", "aenv_vm", "aenv_api", "aenv_fleet", "envd", "codeint",
            "aenv_wire", "aenv_http", "aenv_cli"} <= listed
    assert set(config.packages) >= {"aenv_store", "aenv_vm", "envd", "codeint"}
    for module in ("aenv_vm.service", "aenv_store", "aenv_store.formats.catalog", "aenv_wire.errors",
                   "aenv_vm.machine", "aenv_vm.machine.qemu"):
        assert any(typecheck.matches(module, p) for p in config.strict_patterns), module
    for module in ("aenv_vm.sandboxes.manager", "aenv_vm.services", "aenv_api.server.app", "envd.server"):
        assert not any(typecheck.matches(module, p) for p in config.strict_patterns), module


def test_baseline_file_is_well_formed() -> None:
    config = typecheck.load_config()
    text = typecheck.BASELINE.read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines == sorted(lines), "mypy-baseline.txt is kept sorted (scripts/typecheck.py --update)"
    for line in lines:
        m = re.fullmatch(r"(?P<path>[\w/.]+\.py): \[(?P<code>[a-z-]+)\] (?P<message>.+)", line)
        assert m is not None, f"not `path: [code] message`: {line!r}"
        assert not re.match(r"\d", m["message"]), f"a line number slipped in: {line!r}"
        assert not typecheck.is_strict(m["path"], config.strict_patterns), \
            f"an error in a strict module is fixed, never baselined: {line!r}"


def _error(path: str, line: int, message: str, code: str = "misc") -> Any:
    return typecheck.MypyError(path, line, code, message)


def test_baseline_lines_leave_out_line_numbers() -> None:
    a = _error("aenv_vm/x.py", 10, 'Name "f" already defined on line 3', "no-redef")
    b = _error("aenv_vm/x.py", 99, 'Name "f" already defined on line 40', "no-redef")
    assert a.key == b.key == 'aenv_vm/x.py: [no-redef] Name "f" already defined on line N'
    assert str(a) == 'aenv_vm/x.py:10: error: Name "f" already defined on line 3  [no-redef]'


def test_judge_new_gone_and_strict() -> None:
    strict = ("aenv_store.*", "aenv_vm.service")
    old = [_error("aenv_vm/a.py", 1, "old"), _error("aenv_vm/a.py", 5, "old"), _error("envd/b.py", 2, "fixed")]
    baseline = typecheck.read_baseline(typecheck.render_baseline(old))
    assert sum(baseline.values()) == 3      # the same error twice stays two lines

    same = typecheck.judge([_error("aenv_vm/a.py", 7, "old"), _error("aenv_vm/a.py", 30, "old"),
                            _error("envd/b.py", 9, "fixed")], baseline, strict)
    assert same.ok                          # lines moved: nothing to do

    now = [_error("aenv_vm/a.py", 1, "old"), _error("aenv_vm/a.py", 5, "old"), _error("aenv_vm/a.py", 6, "old"),
           _error("aenv_store/c.py", 3, "strict"), _error("aenv_vm/service.py", 4, "strict too")]
    verdict = typecheck.judge(now, baseline, strict)
    assert not verdict.ok
    assert [e.path for e in verdict.strict] == ["aenv_store/c.py", "aenv_vm/service.py"]
    assert [str(e) for e in verdict.new] == ["aenv_vm/a.py:6: error: old  [misc]"]   # a third of two
    assert verdict.gone == ("envd/b.py: [misc] fixed",)
    out: list[str] = []
    typecheck.report(verdict, out)
    assert any("the baseline may only shrink: remove these lines" in line for line in out)
    assert "aenv_store/c.py" not in typecheck.render_baseline(verdict.recorded)


def test_strict_modules_are_matched_like_mypy_overrides() -> None:
    assert typecheck.module_of("aenv_store/cache/__init__.py") == "aenv_store.cache"
    assert typecheck.module_of("aenv_vm/service.py") == "aenv_vm.service"
    assert typecheck.matches("aenv_wire", "aenv_wire.*")
    assert typecheck.matches("aenv_wire.routes", "aenv_wire.*")
    assert not typecheck.matches("aenv_wirex.routes", "aenv_wire.*")
    assert not typecheck.matches("aenv_vm.service_x", "aenv_vm.service")
