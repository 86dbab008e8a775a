"""benchmarks/ab_trees.py: both trees' code runs, alternating, and the table's medians
are those of the rounds' figures; the JSON flattening is checked with hypothesis."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from hypothesis import assume, given, strategies as st

from tests.support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import ab_trees  # noqa: E402

# A "benchmark" that reports which tree's module it imported and a per-call figure: the
# tree's marker module is found through PYTHONPATH, as the real benchmarks find aenv.
FAKE_BENCH = '''
import argparse, json, pathlib, marker
ap = argparse.ArgumentParser(); ap.add_argument("--json", type=pathlib.Path); ap.add_argument("--x", type=float)
a = ap.parse_args()
log = pathlib.Path(marker.LOG); n = len(log.read_text().splitlines()) if log.exists() else 0
with log.open("a") as f: f.write(marker.NAME + "\\n")
a.json.write_text(json.dumps({"tree": {"value": marker.VALUE + n}, "samples": [a.x, a.x * 3, a.x * 2], "ok": True}))
'''


def _tree(root: Path, name: str, value: float, log: Path) -> Path:
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "fake_bench.py").write_text(FAKE_BENCH)
    (root / "marker.py").write_text(f"NAME = {name!r}\nVALUE = {value}\nLOG = {str(log)!r}\n")
    return root


def test_rounds_alternate_and_medians_are_the_rounds(tmp_path: Path) -> None:
    log = tmp_path / "order.log"
    before = _tree(tmp_path / "b", "before", 100.0, log)
    after = _tree(tmp_path / "a", "after", 200.0, log)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ab_trees.py"), "--before", str(before), "--after", str(after),
         "--rounds", "3", "--keep", str(tmp_path / "keep"), "--", "fake_bench.py", "--x", "2"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # ABBA order: round 0 before first, round 1 after first, round 2 before first
    assert log.read_text().split() == ["before", "after", "after", "before", "before", "after"]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:6]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "metric" not in line}
    # tree.value = VALUE + number of earlier calls: before ran as calls 0, 3, 4; after as 1, 2, 5
    assert rows["tree.value"] == [f"{statistics.median([100, 103, 104]):.4g}",
                                  f"{statistics.median([201, 202, 205]):.4g}",
                                  f"{202 / 103:.2f}", "100..104"]
    assert rows["samples"][:2] == ["4", "4"]  # a list counts as its median
    assert "ok" not in rows  # booleans are no metrics
    assert json.loads((tmp_path / "keep" / "after-1.json").read_text())["tree"]["value"] == 202  # round 1 ran after first: call 2


def test_a_failing_round_stops_with_its_status(tmp_path: Path) -> None:
    log = tmp_path / "order.log"
    before = _tree(tmp_path / "b", "before", 1.0, log)
    after = _tree(tmp_path / "a", "after", 1.0, log)
    (after / "benchmarks" / "fake_bench.py").write_text("raise SystemExit(3)\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ab_trees.py"), "--before", str(before), "--after", str(after),
         "--rounds", "1", "--", "fake_bench.py", "--x", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "after round 0 failed with exit status 3" in proc.stderr


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text("abc", min_size=1, max_size=3),
                                                                         children, max_size=4),
    max_leaves=20)


@given(json_values)
def test_flatten_keeps_every_number_once(value: object) -> None:
    flat = ab_trees.flatten(value)

    def numbers(v: object) -> int:
        if isinstance(v, bool):
            return 0
        if isinstance(v, (int, float)):
            return 1
        if isinstance(v, dict):
            return sum(numbers(x) for x in v.values())
        if isinstance(v, list):
            if v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                return 1
            return sum(numbers(x) for x in v)
        return 0

    def has_samples(v: object) -> bool:     # a list of objects: merged by path (the test below)
        if isinstance(v, dict):
            return any(has_samples(x) for x in v.values())
        if isinstance(v, list):
            return (bool(v) and all(isinstance(x, dict) for x in v)) or any(has_samples(x) for x in v)
        return False
    assume(not has_samples(value))
    assert len(flat) == numbers(value)
    assert all(isinstance(x, float) for x in flat.values())


@given(json_values.filter(lambda v: isinstance(v, dict)), st.text(alphabet="ab \n}{", max_size=20))
def test_last_json_object_is_found_after_any_output(value: object, noise: str) -> None:
    text = noise + "\n" + json.dumps({"first": 1}) + "\nprogress...\n" + json.dumps(value, indent=2) + "\n"
    assert ab_trees.last_json_object(text) == value


def test_a_list_of_samples_is_each_fields_median() -> None:
    flat = ab_trees.flatten({"creates": [{"total": 1.0, "x": {"y": 5}}, {"total": 3.0}, {"total": 2.0, "x": {"y": 7}}]})
    assert flat == {"creates[*].total": 2.0, "creates[*].x.y": 6.0}


def test_report_reads_a_kept_run(tmp_path: Path) -> None:
    (tmp_path / "before-0.json").write_text(json.dumps({"t": 1.0}))
    (tmp_path / "before-1.json").write_text(json.dumps({"t": 3.0}))
    (tmp_path / "after-0.out").write_text("log line\n" + json.dumps({"t": 4.0}))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ab_trees.py"), "--report", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| t | 2 | 4 | 2.00 | 1..3 |" in proc.stdout
