"""Installing the guest tools into an image root (aenv_vm/tools): what a tree gets,
and that a hostile tree cannot make the host write (or read) outside it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from aenv_vm.oci.errors import BadImage
from aenv_vm.tools import TOOLS_DIR, ToolsInstallError, ToolsTree, install_tools
from aenv_vm.tools.accounts import AccountFiles, ensure_user, find_account

from .testimages import alpine_like_entries, entries_to_tree


def fake_tools(path: Path, key: str = "k1") -> ToolsTree:
    """A tree shaped like the tools stage's (the install copies it as it is)."""
    for d in ("bin", "envd", "lib"):
        (path / d).mkdir(parents=True, exist_ok=True)
    (path / "init").write_text("#!/.aenv/bin/sh\n")
    os.chmod(path / "init", 0o755)
    (path / "envd" / "__main__.py").write_text("")
    (path / "bin" / "bash").write_bytes(b"\x7fELF static bash")
    (path / "bin" / "busybox").write_bytes(b"\x7fELF static busybox")
    os.chmod(path / "bin" / "bash", 0o755)
    os.chmod(path / "bin" / "busybox", 0o755)
    (path / "bin" / "sh").symlink_to("busybox")
    return ToolsTree(path, key)


def snapshot(d: Path) -> dict[str, tuple[int, int, bytes | str | None]]:
    out: dict[str, tuple[int, int, bytes | str | None]] = {}
    for dirpath, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            body: bytes | str | None = os.readlink(p) if p.is_symlink() else (
                p.read_bytes() if p.is_file() else None)
            out[str(p.relative_to(d))] = (st.st_mode, st.st_mtime_ns, body)
    return out


def test_empty_tree_becomes_bootable(tmp_path: Path) -> None:
    tools = fake_tools(tmp_path / "tools")
    root = tmp_path / "root"
    root.mkdir()
    report = install_tools(root, tools, "/usr/bin:/bin:/opt/x")
    assert (root / TOOLS_DIR / "init").is_file() and (root / TOOLS_DIR / "envd" / "__main__.py").is_file()
    assert json.loads((root / TOOLS_DIR / "image.json").read_text()) == {"path": "/usr/bin:/bin:/opt/x",
                                                                          "tools_key": "k1"}
    assert os.readlink(root / "bin" / "bash") == "/.aenv/bin/bash"
    assert os.readlink(root / "bin" / "sh") == "/.aenv/bin/busybox"
    assert report.linked == ["/bin/bash", "/bin/sh"] and report.user_added
    passwd = (root / "etc" / "passwd").read_text()
    assert passwd.startswith("root:x:0:0:") and "user:x:1000:1000::/home/user:/bin/bash\n" in passwd
    assert "user:x:1000:" in (root / "etc" / "group").read_text()
    assert not (root / "etc" / "shadow").exists()        # none was there: none is made
    home = (root / "home" / "user").stat()
    assert (home.st_uid, home.st_gid) == (1000, 1000) if os.geteuid() == 0 else True
    for d, mode in (("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("run", 0o755)):
        assert (root / d).is_dir() and (root / d).stat().st_mode & 0o7777 == mode, d
    assert (root / "etc" / "resolv.conf").read_text() == "nameserver 10.0.2.3\n"
    assert "127.0.0.1\tlocalhost" in (root / "etc" / "hosts").read_text()


def test_alpine_like_tree_keeps_its_own_programs(tmp_path: Path) -> None:
    tools = fake_tools(tmp_path / "tools")
    root = tmp_path / "root"
    entries_to_tree(alpine_like_entries(), root)
    report = install_tools(root, tools)
    assert report.linked == ["/bin/bash"]                # /bin/sh is the image's busybox
    assert os.readlink(root / "bin" / "sh") == "busybox"
    shadow = (root / "etc" / "shadow").read_text()
    assert shadow.startswith("root:*::0:::::\n") and "user:!:" in shadow
    assert (root / "etc" / "shadow").stat().st_mode & 0o777 == 0o640


def test_existing_user_and_bash_are_left_alone(tmp_path: Path) -> None:
    tools = fake_tools(tmp_path / "tools")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")                  # merged /usr
    (root / "usr" / "bin" / "bash").write_bytes(b"image bash")
    os.chmod(root / "usr" / "bin" / "bash", 0o755)
    passwd = "root:x:0:0::/root:/bin/bash\nuser:x:1234:1234::/work:/bin/zsh\n"
    (root / "etc" / "passwd").write_text(passwd)
    report = install_tools(root, tools)
    assert not report.user_added and (report.uid, report.gid) == (1234, 1234)
    assert (root / "etc" / "passwd").read_text() == passwd
    assert (root / "usr" / "bin" / "bash").read_bytes() == b"image bash"
    assert os.readlink(root / "usr" / "bin" / "sh") == "/.aenv/bin/busybox"   # through the /bin link
    assert report.linked == ["/bin/sh"]


def test_uid_1000_taken_gets_the_next_free(tmp_path: Path) -> None:
    files = AccountFiles(b"root:x:0:0::/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/sh\n",
                         b"root:x:0:\nnode:x:1000:\n", None)
    new, account, added = ensure_user(files, "/bin/bash")
    assert added and (account.uid, account.gid) == (1001, 1001)
    assert find_account(new.passwd, "user") == account
    assert new.group.endswith(b"user:x:1001:\n")


def test_hostile_tree_never_writes_outside(tmp_path: Path) -> None:
    """Symlinks in /etc, /bin, /home, /.aenv and the account files pointing at host
    paths: the install replaces links, follows them only inside the root, and the
    host paths stay exactly as they were."""
    host = tmp_path / "host"
    (host / "etc").mkdir(parents=True)
    (host / "bin").mkdir()
    (host / "home").mkdir()
    (host / "etc" / "passwd").write_text("hostuser:x:0:0::/:/bin/sh\n")
    (host / "etc" / "shadow").write_text("hostuser:secret:::::::\n")
    (host / "etc" / "hosts").write_text("host hosts\n")
    (host / "secret").write_text("do not read")
    before = snapshot(host)
    tools = fake_tools(tmp_path / "tools")
    tools_before = snapshot(tools.path)

    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").symlink_to(host / "etc" / "passwd")          # absolute host path
    (root / "etc" / "shadow").symlink_to("../../host/etc/shadow")          # .. out of the root
    (root / "etc" / "group").symlink_to("/etc/group")                      # loops onto itself
    (root / "etc" / "hosts").symlink_to(host / "etc" / "hosts")
    (root / "etc" / "resolv.conf").symlink_to("../run/systemd/resolve/stub-resolv.conf")
    (root / "bin").symlink_to(host / "bin")                                # a host directory
    (root / "home").symlink_to(str(host / "home"))
    (root / ".aenv").symlink_to(host)                                      # the tools dir itself
    (root / "dev").symlink_to("/dev")
    (root / "run").symlink_to(host)
    report = install_tools(root, tools)

    assert snapshot(host) == before, "the install changed something outside the image root"
    assert snapshot(tools.path) == tools_before
    # links resolved inside the root: /bin -> <root>/<host path>/bin, created there
    inside_bin = root / str(host / "bin").lstrip("/")
    assert os.readlink(inside_bin / "bash") == "/.aenv/bin/bash"
    assert (root / str(host / "home").lstrip("/") / "user").is_dir()
    # the account files are now regular files of the root; the host's user never got in
    for name in ("passwd", "group", "hosts", "resolv.conf"):
        assert not (root / "etc" / name).is_symlink(), name
    assert "hostuser" not in (root / "etc" / "passwd").read_text()
    assert "user:x:1000:1000:" in (root / "etc" / "passwd").read_text()
    assert report.user_added
    assert not (root / ".aenv").is_symlink() and (root / ".aenv" / "init").is_file()
    assert not (root / "dev").is_symlink() and (root / "dev").is_dir()
    assert (root / "run").is_symlink()                  # /run may stay a link (it resolves in the guest)


def test_symlink_loop_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "bin").symlink_to("/usr/bin")
    (root / "usr").symlink_to("/bin/..")
    with pytest.raises(BadImage, match="too many symbolic links"):
        install_tools(root, fake_tools(tmp_path / "tools"))


def test_missing_tools_tree_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    with pytest.raises(ToolsInstallError, match="guest tools tree .* is missing"):
        install_tools(tmp_path / "root", ToolsTree(tmp_path / "nope", "k"))
