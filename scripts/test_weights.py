"""Writes tests/file_weights.json from a JUnit XML report of a whole run (pytest
--junitxml): each test file's seconds, module fixtures included. tests/conftest.py
orders the files heaviest first, so the two workers (--dist loadfile) start the long
files early and the run does not end on one of them while the other worker idles.

    .venv/bin/python scripts/test_weights.py report.xml
"""
from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def weights(report: Path) -> dict[str, float]:
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname") or ""
        if not module.startswith("tests."):
            continue
        # classname is the module's dotted path, plus a class when the test is in one
        parts = module.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if parts:
            seconds["/".join(parts) + ".py"] += float(case.get("time") or 0)
    return {f: round(s, 1) for f, s in seconds.most_common() if s >= 5}


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = REPO / "tests" / "file_weights.json"
    w = weights(Path(sys.argv[1]))
    out.write_text(json.dumps(w, indent=0) + "\n")
    print(f"{out.relative_to(REPO)}: {len(w)} files, {sum(w.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
