"""An image converted with other guest tools is converted again (pull and load), with
its layers from the node's layer cache; with the same tools it is reused."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from aenv_store.assembly import open_node_store
from aenv_store.config import StorePaths, StoreSettings
from aenv_vm.oci.archive import load_archive
from aenv_vm.oci.config import OciConfig
from aenv_vm.oci.pull import Puller

from tests.aenv_vm.oci.ocibuild import D, F
from tests.aenv_vm.oci.registryproc import Registry
from .test_install import fake_tools
from .testimages import write_layout

ENTRIES = [D("etc"), F("etc/os-release", "ID=reconvert\n")]


def test_other_tools_key_converts_again(start_registry: Callable[..., Registry], data_dir: Path,
                                        tmp_path: Path) -> None:
    old, new = fake_tools(tmp_path / "t1", "old-key"), fake_tools(tmp_path / "t2", "new-key")
    lay = write_layout(tmp_path / "layout", ENTRIES, "1", {"Env": ["PATH=/bin"]})
    reg = start_registry()
    reg.push(lay.root, "1", "test/re:1")
    ref = f"{reg.host}/test/re:1"
    store = open_node_store(StoreSettings(paths=StorePaths(data_dir)), create=True)
    try:
        lines: list[str] = []
        first = Puller(store, OciConfig(), data_dir, ref, tools=old, log_line=lines.append).run()
        assert not first.image.reused and first.image.meta["tools_key"] == "old-key"
        same = Puller(store, OciConfig(), data_dir, ref, tools=old).run()
        assert same.image.reused and same.image.layer_id == first.image.layer_id
        lines.clear()
        again = Puller(store, OciConfig(), data_dir, ref, tools=new, log_line=lines.append).run()
        assert not again.image.reused and again.image.name == first.image.name
        assert again.image.meta["tools_key"] == "new-key" and again.image.layer_id != first.image.layer_id
        assert again.downloaded_bytes < 2048 and again.cached_layers == 1      # config only: layers cached
        assert any("other guest tools" in line for line in lines)
        assert dict(store.get_record(first.image.name).meta)["tools_key"] == "new-key"
        by_digest = Puller(store, OciConfig(), data_dir, f"{reg.host}/test/re@{first.digest}", tools=new).run()
        assert by_digest.image.reused and by_digest.image.layer_id == again.image.layer_id
        # the same for an archive
        loaded = load_archive(store, OciConfig(), data_dir, lay.root, tools=new)
        assert loaded.reused
        reloaded = load_archive(store, OciConfig(), data_dir, lay.root, tools=old)
        assert not reloaded.reused and reloaded.meta["tools_key"] == "old-key"
    finally:
        store.close()
