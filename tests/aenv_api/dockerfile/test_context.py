"""The build context: .dockerignore, globs, the ways out of the context that are
refused, ADD of archives, the files hash (E2B's) and the tar."""
from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aenv_api.dockerfile import DockerfileError
from aenv_api.dockerfile.context import BuildContext, DockerIgnore
from aenv_api.dockerfile.convert import CopySource


def copy(src: str, dest: str = "/d/", keyword: str = "COPY", line: int = 5) -> CopySource:
    return CopySource(0, src, dest, line, keyword)


@pytest.fixture
def ctx(tmp_path: Path) -> Path:
    root = tmp_path / "ctx"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print(1)\n")
    (root / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "src" / "pkg" / "mod.pyc").write_bytes(b"\0")
    (root / "README.md").write_text("readme\n")
    (root / "notes.md").write_text("notes\n")
    (root / ".env").write_text("SECRET=1\n")
    (root / "src" / "inner-link").symlink_to("main.py")
    return root


def paths(root: Path, src: str, dest: str = "/d/") -> tuple[str, ...]:
    return BuildContext(root).collect(copy(src, dest)).paths


def test_sources_files_directories_globs(ctx: Path) -> None:
    assert paths(ctx, "README.md", "/r") == ("README.md",)
    assert paths(ctx, "src") == ("src", "src/inner-link", "src/main.py", "src/pkg", "src/pkg/mod.py",
                                 "src/pkg/mod.pyc")
    assert paths(ctx, "./src/pkg/") == ("src/pkg", "src/pkg/mod.py", "src/pkg/mod.pyc")
    assert paths(ctx, "*.md") == ("README.md", "notes.md")
    assert paths(ctx, "src/*.py") == ("src/main.py",)
    assert paths(ctx, "**/*.py") == ("src/main.py", "src/pkg/mod.py")
    assert paths(ctx, ".")[0] == "." and ".env" in paths(ctx, ".")
    assert paths(ctx, "src/pkg/../main.py", "/m") == ("src/main.py",)


def test_dockerignore(ctx: Path) -> None:
    (ctx / ".dockerignore").write_text("# secrets\n.env\n**/*.pyc\nsrc/pkg\n!src/pkg/mod.py\n*.md\n!README.md\n")
    assert paths(ctx, ".") == (".", ".dockerignore", "README.md", "src", "src/inner-link", "src/main.py",
                               "src/pkg/mod.py")
    with pytest.raises(DockerfileError, match="line 5: COPY source notes.md matches no files.*dockerignore"):
        paths(ctx, "notes.md", "/n")


def test_ignore_rules() -> None:
    ig = DockerIgnore(["/build", "*.log", "!keep.log", "docs/**/*.tmp"])
    assert ig.excluded("build") and ig.excluded("build/x/y") and not ig.excluded("src/build")
    assert ig.excluded("a.log") and not ig.excluded("keep.log") and not ig.excluded("d/a.log")
    assert ig.excluded("docs/a/b/c.tmp") and ig.excluded("docs/c.tmp") and not ig.excluded(".")


def test_sources_that_leave_the_context_are_refused(ctx: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    (ctx / "out-link").symlink_to(outside / "secret")
    (ctx / "out-dir").symlink_to(outside)
    (ctx / "src" / "pkg" / "rel-out").symlink_to("../../../outside/secret")
    c = BuildContext(ctx)
    for src, match in (("out-link", "symbolic link out of the build context"),
                       ("out-dir/secret", "leads out of the build context through a symbolic link"),
                       ("src", "src/pkg/rel-out is a symbolic link out"),
                       ("*-link", "symbolic link out"),
                       ("../outside/secret", "outside the build context")):
        with pytest.raises(DockerfileError, match=match) as info:
            c.collect(copy(src, "/x/"))
        assert info.value.line == 5


def test_missing_and_ambiguous_sources(ctx: Path) -> None:
    with pytest.raises(DockerfileError, match="line 5: COPY source nope matches no files"):
        paths(ctx, "nope")
    with pytest.raises(DockerfileError, match="matches several files: the destination must be a directory"):
        paths(ctx, "*.md", "/file")
    with pytest.raises(DockerfileError, match="is not a directory"):
        BuildContext(ctx / "README.md")


def test_add_of_an_archive_is_refused(ctx: Path) -> None:
    (ctx / "a.tgz").write_bytes(gzip.compress(b"x"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        t.addfile(tarfile.TarInfo("f"), io.BytesIO(b""))
    (ctx / "plain.tar").write_bytes(buf.getvalue())
    for name, kind in (("a.tgz", "gzip"), ("plain.tar", "tar")):
        with pytest.raises(DockerfileError, match=f"ADD of a local archive \\({name}, {kind}\\)"):
            BuildContext(ctx).collect(copy(name, "/x/", keyword="ADD"))
        BuildContext(ctx).collect(copy(name, "/x/"))          # COPY of it is fine
    BuildContext(ctx).collect(copy("README.md", "/x/", keyword="ADD"))


def test_hash_covers_paths_modes_contents_and_dest(ctx: Path) -> None:
    c = BuildContext(ctx)
    first = c.collect(copy("src")).files_hash
    assert c.collect(copy("src")).files_hash == first                 # deterministic
    assert c.collect(copy("src", "/other/")).files_hash != first       # the dest
    (ctx / "src" / "main.py").write_text("print(2)\n")                # same size, other bytes
    second = c.collect(copy("src")).files_hash
    assert second != first
    (ctx / "src" / "main.py").chmod(0o700)
    third = c.collect(copy("src")).files_hash
    assert third != second
    (ctx / "src" / "pkg" / "mod.py").rename(ctx / "src" / "pkg" / "mod2.py")
    assert c.collect(copy("src")).files_hash != third
    os.utime(ctx / "src" / "main.py", (1, 1))                          # mtimes do not count
    assert c.collect(copy("src")).files_hash == c.collect(copy("src")).files_hash


def test_hash_is_the_sdks(ctx: Path) -> None:
    utils = pytest.importorskip("e2b.template.utils")
    (ctx / ".dockerignore").write_text("*.pyc\n")
    c = BuildContext(ctx)
    for src in ("src", "*.md", ".", "src/inner-link", "**/*.py"):
        ours = c.collect(copy(src, "/d/")).files_hash
        theirs = utils.calculate_files_hash(src, "/d/", str(ctx), utils.read_dockerignore(str(ctx)), False, None)
        assert ours == theirs, src


def test_tar_holds_the_paths_as_links_and_files(ctx: Path) -> None:
    c = BuildContext(ctx)
    files = c.collect(copy("src"))
    buf = io.BytesIO()
    c.write_tar(files, buf)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue()), mode="r:gz") as t:
        members = {m.name: m for m in t.getmembers()}
        assert tuple(members) == files.paths
        assert members["src/inner-link"].issym() and members["src/inner-link"].linkname == "main.py"
        assert members["src/pkg"].isdir() and members["src/main.py"].uid == 0
        assert t.extractfile("src/pkg/mod.py").read() == b"x = 1\n"  # type: ignore[union-attr]
    assert files.data_bytes == len("print(1)\n") + len("x = 1\n") + 1


@given(st.lists(st.from_regex(r"[a-c]{1,2}(/[a-c]{1,2}){0,2}", fullmatch=True), min_size=1, max_size=8, unique=True))
def test_a_directory_copy_takes_every_file_once(tmp_path_factory: pytest.TempPathFactory, rels: list[str]) -> None:
    root = tmp_path_factory.mktemp("h")
    made = set()
    for rel in rels:
        p = root / "top" / rel
        if any(parent.is_file() for parent in p.parents) or p.is_dir():
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)
        made.add("top/" + rel)
    got = BuildContext(root).collect(copy("top")).paths
    assert len(set(got)) == len(got) and {p for p in got if (root / p).is_file()} == made
    assert all(("/".join(p.split("/")[:-1]) or ".") in got or p == "top" for p in got)
