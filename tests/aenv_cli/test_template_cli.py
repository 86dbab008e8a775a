"""`aenv template build|ls|rm` through the real CLI entry point."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from aenv_cli.main import main
from aenv_vm.guest import GuestImage
from tests.aenv_vm.vm.conftest import guest, no_leaked_qemu  # noqa: F401  (fixtures: the cached guest, a QEMU leak check)


def test_bad_sizes_are_rejected(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["template", "build", "--memory-mib", "8", "--data-dir", str(tmp_path)]) == 2
    assert "aenv: error: --memory-mib must be >= 64" in capsys.readouterr().err


def _check_disk_size(guest: GuestImage, data: Path, template: str, mib: int) -> None:
    """A sandbox of the template sees a root filesystem grown to the template's disk size."""
    from aenv_cli.config import load_config
    from aenv_store.store import Store
    from aenv_vm.sandboxes.manager import SandboxManager

    async def run() -> None:
        with Store.open(load_config(data_dir=data).store_settings()) as store:
            async with SandboxManager(store, guest, data / "node") as mgr:
                sbx = await mgr.create(template)
                try:
                    res = await sbx.envd.run("df -BM --output=size / | tail -1", user="root", timeout=60.0)
                    size = int(res.stdout.decode().strip().rstrip("M"))
                    # ext4 keeps a few % for its own metadata; the 4 GiB image would show ~3.9 G
                    assert mib * 0.95 < size <= mib, size
                finally:
                    await mgr.kill(sbx.id)
    asyncio.run(run())


@pytest.mark.qemu
def test_build_ls_rm(guest: GuestImage, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path / "data")]
    assert main(["template", "build", "cli-tpl", "--disk-mib", "100", *data]) == 1
    assert "aenv: error: disk_mib 100 is smaller than the guest image (4096 MiB)" in capsys.readouterr().err
    assert main(["template", "build", "cli-tpl", "--json", "--disk-mib", "5120", *data]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["disk_mib"] == 5120
    _check_disk_size(guest, tmp_path / "data", "cli-tpl", 5120)
    # The guest key is the build's current one (it moves if envd/ is edited during a run).
    assert built["id"].startswith("tpl-") and built["aliases"] == "cli-tpl" and len(built["guest"]) == 16
    assert main(["template", "ls", "--local", "--json", *data]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [built["id"]]
    assert main(["template", "rm", "--local", "cli-tpl", *data]) == 0
    capsys.readouterr()
    assert main(["template", "rm", "--local", "cli-tpl", *data]) == 1
    assert "aenv: error: unknown template 'cli-tpl'" in capsys.readouterr().err
    assert main(["template", "ls", "--local", "--json", *data]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert not [p for p in (tmp_path / "data").iterdir() if p.name.startswith("template-build-")]
