"""Layer flattening (aenv_vm/oci/layers.py): overlay semantics and hostile tars."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_vm.oci.errors import BadImage
from aenv_vm.oci.layers import apply_layers

from .ocibuild import D, Entry, F, H, L, compress, make_tar


def write_layers(tmp: Path, layers: list[list[Entry]], how: str = "none") -> list[tuple[Path, str, str | None]]:
    out = []
    for i, entries in enumerate(layers):
        p = tmp / f"layer{i}.tar"
        p.write_bytes(compress(make_tar(entries), how))
        out.append((p, f"layer {i}", None))
    return out


def tree(root: Path) -> dict[str, str]:
    """path -> short description of everything under root (no link followed)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st_ = p.lstat()
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = "-> " + os.readlink(p)
            elif stat.S_ISDIR(st_.st_mode):
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes().decode(errors="replace")
    return out


@pytest.mark.parametrize("how", ["none", "gzip", "zstd"])
def test_overlay_semantics(tmp_path: Path, how: str) -> None:
    base = [D("etc"), F("etc/passwd", "root:x:0:0\n"), F("etc/gone", "x"), D("opt"), D("opt/a"),
            F("opt/a/old", "old"), D("opt/keep"), F("opt/keep/k", "k"), F("bin/sh", "#!", mode=0o4755, uid=0),
            D("var"), F("var/lower", "l")]
    top = [F("etc/.wh.gone"), D("opt/a"), F("opt/a/.wh..wh..opq"), F("opt/a/new", "new"),
           L("usr-link", "/etc/passwd"), H("bin/sh2", "bin/sh"), F("home/u/f", "u", uid=1000, gid=1000, mode=0o600),
           F("var/.wh..wh..opq")]
    root = tmp_path / "root"
    stats = apply_layers(root, write_layers(tmp_path, [base, top], how))
    got = tree(root)
    assert "etc/gone" not in got and "opt/a/old" not in got and "var/lower" not in got
    assert got["opt/a/new"] == "new" and got["opt/keep/k"] == "k" and got["var"] == "dir"
    assert got["usr-link"] == "-> /etc/passwd"
    assert not any(".wh." in k for k in got)
    assert os.stat(root / "bin/sh").st_ino == os.stat(root / "bin/sh2").st_ino
    assert stat.S_IMODE(os.stat(root / "bin/sh").st_mode) == 0o4755
    st_ = os.stat(root / "home/u/f")
    assert (st_.st_uid, st_.st_gid, stat.S_IMODE(st_.st_mode)) == (1000, 1000, 0o600)
    assert st_.st_mtime == 1_700_000_000
    assert stats.whiteouts >= 3


def test_parents_a_layer_does_not_list_are_0755_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        apply_layers(tmp_path / "root", write_layers(tmp_path, [[F("usr/lib/x", "x")]]))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "root/usr").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "root/usr/lib").st_mode) == 0o755


def test_opaque_dir_keeps_what_the_same_layer_wrote(tmp_path: Path) -> None:
    base = [D("d"), D("d/sub"), F("d/sub/lower", "x"), F("d/lowerfile", "y")]
    # the marker comes *after* entries of its own layer, as some tools write it
    top = [D("d"), D("d/sub"), F("d/sub/mine", "m"), F("d/.wh..wh..opq")]
    root = tmp_path / "root"
    apply_layers(root, write_layers(tmp_path, [base, top]))
    assert tree(root) == {"d": "dir", "d/sub": "dir", "d/sub/mine": "m"}


def test_a_whiteout_hides_only_lower_layers(tmp_path: Path) -> None:
    base = [D("d"), F("d/lower", "l"), F("f", "lower f")]
    top = [D("d"), F("d/mine", "m"), F("d2/x", "x"), F(".wh.d"), F(".wh.d2"), F("f", "top f"), F(".wh.f")]
    root = tmp_path / "root"
    apply_layers(root, write_layers(tmp_path, [base, top]))
    assert tree(root) == {"d": "dir", "d/mine": "m", "d2": "dir", "d2/x": "x", "f": "top f"}


def test_file_replaces_dir_and_dir_replaces_symlink(tmp_path: Path) -> None:
    base = [D("x"), F("x/inner", "i"), L("y", "/etc")]
    top = [F("x", "now a file"), D("y"), F("y/z", "z")]
    root = tmp_path / "root"
    (tmp_path / "outside").mkdir()
    apply_layers(root, write_layers(tmp_path, [base, top]))
    assert tree(root) == {"x": "now a file", "y": "dir", "y/z": "z"}


# ---------------------------------------------------------------- hostile layers

def assert_nothing_outside(tmp_path: Path, before: set[str]) -> None:
    now = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
           if not str(p.relative_to(tmp_path)).startswith(("root", "layer"))}
    assert now == before, f"written outside the root: {now - before}"


@pytest.mark.parametrize("layers", [
    [[F("../escape", "x")]],
    [[F("a/../../escape", "x")]],
    [[H("link", "../outside/secret")]],
])
def test_dotdot_is_refused(tmp_path: Path, layers: list[list[Entry]]) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("s")
    before = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    with pytest.raises(BadImage, match=r"\.\."):
        apply_layers(tmp_path / "root", write_layers(tmp_path, layers))
    assert_nothing_outside(tmp_path, before)


@pytest.mark.parametrize("layers", [
    # absolute names land inside the root
    [[F("/abs", "in root")]],
    # a symlink to outside, then a file through it (same layer and next layer)
    [[L("evil", str(Path("/tmp")) + "/../" + "x"), F("evil/f", "x")]],
    [[L("evil", "../../../../outside")], [F("evil/secret", "overwritten")]],
    # a symlink as the file itself: the file replaces the link, it is not written through
    [[L("target", "../outside/secret")], [F("target", "replaced")]],
    # a hardlink whose target path goes through a symlink pointing outside
    [[L("evil", "/../outside"), H("stolen", "evil/secret")]],
    # a symlink replaced by a dir in a later layer, then written into
    [[L("d", "../outside")], [D("d"), F("d/secret", "mine")]],
    # whiteouts through a symlink
    [[L("evil", "../outside")], [F("evil/.wh.secret")]],
    [[L("evil", "../outside")], [F("evil/.wh..wh..opq")]],
    # symlink loops end with an error, not a hang
    [[L("a", "b"), L("b", "a"), F("a/x", "x")]],
])
def test_hostile_layers_stay_inside_root(tmp_path: Path, layers: list[list[Entry]]) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    before = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    root = tmp_path / "root"
    try:
        apply_layers(root, write_layers(tmp_path, layers))
    except BadImage:
        pass
    assert (outside / "secret").read_text() == "s"
    assert_nothing_outside(tmp_path, before)


def test_device_nodes_are_skipped_with_a_note(tmp_path: Path) -> None:
    stats = apply_layers(tmp_path / "root", write_layers(tmp_path, [[D("dev"), Entry("dev/null", "c"),
                                                                      Entry("fifo", "p", mode=0o644)]]))
    assert not (tmp_path / "root/dev/null").exists()
    assert stat.S_ISFIFO((tmp_path / "root/fifo").lstat().st_mode)
    assert any("device node" in n for n in stats.notes)


def test_corrupt_and_truncated_layers_are_clear_errors(tmp_path: Path) -> None:
    data = compress(make_tar([F("a", "x" * 100_000)]), "gzip")
    (tmp_path / "t.tar.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadImage, match="layer"):
        apply_layers(tmp_path / "root", [(tmp_path / "t.tar.gz", "layer t", None)])
    (tmp_path / "z").write_bytes(b"\x28\xb5\x2f\xfd" + b"garbage" * 100)
    with pytest.raises(BadImage, match="layer z"):
        apply_layers(tmp_path / "root2", [(tmp_path / "z", "layer z", None)])


def test_diff_id_is_checked(tmp_path: Path) -> None:
    p = tmp_path / "l.tar"
    p.write_bytes(make_tar([F("a", "x")]))
    with pytest.raises(BadImage, match="image config says"):
        apply_layers(tmp_path / "root", [(p, "layer 0", "sha256:" + "0" * 64)])


_names = st.lists(st.sampled_from(["a", "b", "..", ".", "", "/", "c", ".wh.a", ".wh..wh..opq"]),
                  min_size=1, max_size=5).map("/".join)
_entries = st.builds(lambda kind, name, link: Entry(name, kind, b"data", link=link),
                     st.sampled_from("fdlh"), _names,
                     st.one_of(_names, st.sampled_from(["/", "/..", "../../..", "/tmp", "../outside"])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.lists(st.lists(_entries, min_size=1, max_size=8), min_size=1, max_size=3))
def test_random_hostile_layers_never_write_outside(tmp_path: Path, layers: list[list[Entry]]) -> None:
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        outside = work / "outside"
        outside.mkdir()
        (outside / "secret").write_text("s")
        (outside / "a").write_text("a")
        before = {str(p.relative_to(work)) for p in work.rglob("*")}
        try:
            apply_layers(work / "root", write_layers(work, layers))
        except BadImage:
            pass
        assert (outside / "secret").read_text() == "s" and (outside / "a").read_text() == "a"
        assert_nothing_outside(work, before)
    finally:
        shutil.rmtree(work)


# ---------------------------------------------------------------- a model of overlay semantics

_comp = st.sampled_from(["a", "b", "c"])
_path = st.lists(_comp, min_size=1, max_size=3)
_model_entry = st.one_of(
    st.tuples(st.just("f"), _path, st.binary(max_size=3)),
    st.tuples(st.just("d"), _path, st.just(b"")),
    st.tuples(st.just("wh"), _path, st.just(b"")),
    st.tuples(st.just("opq"), st.lists(_comp, max_size=2), st.just(b"")),
)


class _ModelError(Exception):
    pass


def _model_apply(model: dict[tuple[str, ...], bytes | None], layer: list[tuple[str, list[str], bytes]]) -> None:
    """What a layer does, on a dict path -> file bytes (None: a directory)."""
    touched: set[tuple[str, ...]] = set()

    def ensure_parents(parts: tuple[str, ...]) -> None:
        for i in range(1, len(parts)):
            p = parts[:i]
            if p not in model:
                model[p] = None
            elif model[p] is not None:
                raise _ModelError("a parent is a file")

    def remove(p: tuple[str, ...]) -> None:
        for k in [k for k in model if k[:len(p)] == p]:
            del model[k]

    for kind, path, data in layer:
        parts = tuple(path)
        if kind == "wh":
            parent = parts[:-1]
            if not all(model.get(parent[:i], b"") is None for i in range(1, len(parent) + 1)):
                continue
            if parts not in touched:
                remove(parts)
            elif model.get(parts, b"") is None:         # this layer's dir: only its own part stays
                for k in [k for k in model if k[:len(parts)] == parts and len(k) > len(parts)
                          and k not in touched]:
                    del model[k]
            continue
        if kind == "opq":
            if parts and model.get(parts, b"") is not None:
                continue
            for k in [k for k in model if k[:len(parts)] == parts and len(k) > len(parts) and k not in touched]:
                model.pop(k, None)
            continue
        ensure_parents(parts)
        if kind == "f":
            remove(parts)
            model[parts] = data
        elif model.get(parts, None) is not None:       # a dir over a file
            remove(parts)
            model[parts] = None
        else:
            model[parts] = None
        touched.update(parts[:i] for i in range(1, len(parts) + 1))


def _to_entries(layer: list[tuple[str, list[str], bytes]]) -> list[Entry]:
    out = []
    for kind, path, data in layer:
        if kind == "wh":
            out.append(F("/".join(path[:-1] + [".wh." + path[-1]])))
        elif kind == "opq":
            out.append(F("/".join(path + [".wh..wh..opq"])))
        elif kind == "f":
            out.append(F("/".join(path), data))
        else:
            out.append(D("/".join(path)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.lists(st.lists(_model_entry, min_size=1, max_size=6), min_size=1, max_size=4))
def test_flattening_matches_a_model_of_overlay_semantics(tmp_path: Path,
                                                         layers: list[list[tuple[str, list[str], bytes]]]) -> None:
    import shutil
    import tempfile

    model: dict[tuple[str, ...], bytes | None] = {}
    try:
        for layer in layers:
            _model_apply(model, layer)
        expect_error = False
    except _ModelError:
        expect_error = True
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        files = write_layers(work, [_to_entries(layer) for layer in layers])
        if expect_error:
            with pytest.raises(BadImage, match="not a directory"):
                apply_layers(work / "root", files)
            return
        apply_layers(work / "root", files)
        got = {tuple(k.split("/")): (None if v == "dir" else v.encode("latin-1", "replace"))
               for k, v in tree(work / "root").items()}
        want = {k: (None if v is None else v.decode(errors="replace").encode("latin-1", "replace"))
                for k, v in model.items()}
        assert got == want
    finally:
        shutil.rmtree(work)


def test_xattrs_user_and_capabilities_kept_others_noted(tmp_path: Path) -> None:
    cap = "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"  # cap_net_raw
    layer = [F("ping", "x", mode=0o755, xattrs={"user.origin": "layer", "security.capability": cap,
                                              "trusted.overlay.opaque": "y"})]
    stats = apply_layers(tmp_path / "root", write_layers(tmp_path, [layer]))
    p = tmp_path / "root" / "ping"
    assert os.getxattr(p, "user.origin") == b"layer"
    assert os.getxattr(p, "security.capability") == cap.encode("utf-8", "surrogateescape")
    assert "trusted.overlay.opaque" not in os.listxattr(p)
    assert any("trusted.overlay.opaque" in n for n in stats.notes)


def test_without_root_owners_are_noted_not_fatal(tmp_path: Path) -> None:
    """Flattening as an ordinary user (chown not allowed): files belong to the running
    user and a note says so. (The writer's own switch: the venv's interpreter is not
    runnable by another user here.)"""
    from aenv_vm.oci.layers import ApplyStats, RootWriter, apply_layer

    layer = tmp_path / "l.tar"
    layer.write_bytes(make_tar([D("home"), F("home/f", "x", uid=1000, gid=1000), F("suid", "s", mode=0o4755)]))
    stats = ApplyStats()
    writer = RootWriter(tmp_path / "root", stats)
    writer.can_chown = False
    try:
        with open(layer, "rb") as f:
            apply_layer(writer, f, "l")
    finally:
        writer.close()
    assert any("not running as root" in n for n in stats.notes)
    assert os.stat(tmp_path / "root/home/f").st_uid == os.geteuid()
    assert stat.S_IMODE(os.stat(tmp_path / "root/suid").st_mode) == 0o4755


def test_flattening_stops_at_the_free_disk_floor(tmp_path: Path) -> None:
    """An image of many empty files (or big ones) flattened on a node near its floor stops
    with a clear error before the entry that would cross it, in bytes or in inodes."""
    from aenv_store.diskfloor import DiskFloor, free_space
    from aenv_vm.oci.errors import OciError

    free = free_space(tmp_path)
    layers = write_layers(tmp_path, [[D("d")] + [F(f"d/f{i}", "") for i in range(50)]])
    with pytest.raises(OciError, match=r"min_free_disk") as e:
        apply_layers(tmp_path / "root", layers, floor=DiskFloor(free.bytes + (1 << 30), 0))
    assert not isinstance(e.value, BadImage)                 # the node's state, not a bad image
    assert not (tmp_path / "root" / "d").exists()
    if free.inodes is not None:
        with pytest.raises(OciError, match=r"min_free_inodes"):
            apply_layers(tmp_path / "root2", layers, floor=DiskFloor(0, free.inodes + 10))
    stats = apply_layers(tmp_path / "root3", layers, floor=DiskFloor(1, 1))
    assert stats.entries == 51
