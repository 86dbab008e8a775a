"""`aenv image load`: docker-save tarballs and OCI layouts (directory or tar)."""
from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

from .conftest import BASE, EXPECTED_TREE, EXTRA, RUNTIME, TOP, PushedImages, read_tree, run_aenv
from .ocibuild import Layer, docker_save_tar
from .test_pull import assert_verify_clean, export_image, image_names


def test_docker_save_tarball(data_dir: Path, tmp_path: Path) -> None:
    tar = tmp_path / "save.tar"
    docker_save_tar(tar, [Layer(BASE, "none"), Layer(TOP, "gzip"), Layer(EXTRA, "none")], RUNTIME, "myapp:1.0")
    r = run_aenv(data_dir, "image", "load", str(tar), "--output", "json")
    assert r.code == 0, r.err
    info = r.json()
    assert info["reference"] == "myapp:1.0" and info["config"] == RUNTIME
    tree = read_tree(export_image(data_dir, info["name"], tmp_path / "disk.raw"))
    assert {p: v[:5] for p, v in tree.items()} == EXPECTED_TREE
    again = run_aenv(data_dir, "image", "load", str(tar), "--output", "json").json()
    assert again["reused"] and again["name"] == info["name"]
    assert_verify_clean(data_dir)


def test_oci_layout_directory_and_tar(images: PushedImages, data_dir: Path, tmp_path: Path) -> None:
    r = run_aenv(data_dir, "image", "load", str(images.layout))
    assert r.code != 0 and "--tag" in r.err, r.err             # several images: which one?
    d = run_aenv(data_dir, "image", "load", str(images.layout), "--tag", "v1", "--output", "json")
    assert d.code == 0, d.err
    assert d.json()["digest"] == images.amd64["digest"] and d.json()["reference"] == "layout:v1"
    tree = read_tree(export_image(data_dir, d.json()["name"], tmp_path / "disk.raw"))
    assert {p: v[:5] for p, v in tree.items()} == EXPECTED_TREE
    # a tar of the layout, the multi-platform index in it: amd64 is picked, the same image
    tar = tmp_path / "layout.tar"
    subprocess.run(["tar", "-C", str(images.layout), "-cf", str(tar), "."], check=True)
    t = run_aenv(data_dir, "image", "load", str(tar), "--tag", "multi", "--output", "json")
    assert t.code == 0, t.err
    assert t.json()["digest"] == images.amd64["digest"] and t.json()["reused"]
    arm = run_aenv(data_dir, "image", "load", str(tar), "--tag", "armlist")
    assert arm.code == 1 and "no linux/amd64" in arm.err
    assert_verify_clean(data_dir)


def test_bad_archives_are_clear_errors(images: PushedImages, data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(b"not an archive at all")
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w"):
        pass
    # a docker-save archive whose layer was changed after the config was written
    tampered = tmp_path / "tampered.tar"
    docker_save_tar(tampered, [Layer(BASE, "none")], {}, "t:1")
    with tarfile.open(tampered) as src:
        members = [(m, src.extractfile(m).read() if m.isfile() else b"") for m in src.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(tampered, "w") as out:
        import io
        for m, data in members:
            if m.name.endswith("layer.tar"):
                data = data.replace(b"ID=test", b"ID=evil")
            m.size = len(data)
            out.addfile(m, io.BytesIO(data))
    # an OCI layout with a blob that does not match its name
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-a", str(images.layout), str(broken)], check=True)
    manifest = json.loads((broken / "blobs/sha256" / images.amd64["digest"][7:]).read_text())
    layer_blob = broken / "blobs/sha256" / manifest["layers"][0]["digest"][7:]
    data = bytearray(layer_blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer_blob.write_bytes(bytes(data))
    cases = [(tmp_path / "missing.tar", "no such file"), (tmp_path / "junk", "not a tar"),
             (empty, "neither an OCI image layout"), (tampered, "image config says"), (broken, "corrupt")]
    for path, why in cases:
        args = ["image", "load", str(path)] + (["--tag", "v1"] if path == broken else [])
        r = run_aenv(data_dir, *args)
        assert r.code != 0 and r.err.splitlines()[-1].startswith("aenv: error:") and why in r.err, (path, r.err)
    assert image_names(data_dir) == []
    assert_verify_clean(data_dir)
