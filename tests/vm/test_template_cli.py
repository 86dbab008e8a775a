"""`aenv template build|ls|rm` through the real CLI entry point."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from aenv_api.cli.main import main
from aenv_vm.guest import GuestImage


def test_bad_sizes_are_rejected(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["template", "build", "--memory-mib", "8", "--data-dir", str(tmp_path)]) == 2
    assert "aenv: error: --memory-mib must be >= 64" in capsys.readouterr().err


@pytest.mark.qemu
def test_build_ls_rm(guest: GuestImage, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path / "data")]
    assert main(["template", "build", "cli-tpl", "--json", *data]) == 0
    built = json.loads(capsys.readouterr().out)
    # The guest key is the build's current one (it moves if envd/ is edited during a run).
    assert built["id"].startswith("tpl-") and built["aliases"] == "cli-tpl" and len(built["guest"]) == 16
    assert main(["template", "ls", "--json", *data]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [built["id"]]
    assert main(["template", "rm", "cli-tpl", *data]) == 0
    capsys.readouterr()
    assert main(["template", "rm", "cli-tpl", *data]) == 1
    assert "aenv: error: unknown template 'cli-tpl'" in capsys.readouterr().err
    assert main(["template", "ls", "--json", *data]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert not [p for p in (tmp_path / "data").iterdir() if p.name.startswith("template-build-")]
