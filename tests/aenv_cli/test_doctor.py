"""`aenv doctor` through the real CLI entry point."""
from __future__ import annotations

import json

import pytest

from aenv_cli.main import main
from tests.aenv_vm.vm.conftest import guest, no_leaked_qemu  # noqa: F401  (fixtures: the cached guest, a QEMU leak check)


def run_doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, dict]]:
    code = main(["doctor", "--json", *args])
    rows = json.loads(capsys.readouterr().out)
    return code, {r["check"]: r for r in rows}


def test_doctor_reports_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = run_doctor(capsys, "--no-probe")
    assert set(checks) >= {"qemu", "qemu-img", "guest", "/dev/kvm", "accelerator", "disk (data dir)"}
    assert checks["qemu"]["status"] == "ok" and "QEMU 7." in checks["qemu"]["detail"] or \
        checks["qemu"]["status"] == "fail"
    assert code == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)


def test_doctor_reports_ksm(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                            tmp_path) -> None:  # type: ignore[no-untyped-def]
    from aenv_vm import ksm
    _, checks = run_doctor(capsys, "--no-probe")
    if ksm.available() and ksm.process_merge_supported():
        assert checks["ksm"]["status"] == "ok" and "full scans" in checks["ksm"]["detail"]
    monkeypatch.setattr(ksm, "KSM_SYSFS", tmp_path / "no-ksm")   # a kernel built without KSM
    _, checks = run_doctor(capsys, "--no-probe")
    assert checks["ksm"]["status"] == "warn" and "[vm] ksm = false" in checks["ksm"]["detail"]


def test_doctor_fails_clearly_without_qemu(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_QEMU_BINARY", "qemu-system-missing")
    code, checks = run_doctor(capsys, "--no-probe")
    assert code == 1
    assert checks["qemu"]["status"] == "fail" and "qemu-system-missing not found" in checks["qemu"]["detail"]
    assert checks["accelerator"]["status"] == "fail"


@pytest.mark.qemu
def test_doctor_probes_the_accelerator(guest, capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = run_doctor(capsys)
    assert code == 0
    assert checks["guest"]["status"] == "ok" and guest.kernel_release in checks["guest"]["detail"]
    assert checks["guest-tools"]["status"] == "ok" and guest.tools_key in checks["guest-tools"]["detail"]
    assert checks["accelerator"]["detail"].startswith(("TCG", "KVM"))


def test_doctor_reports_network_isolation(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv_vm.net import networks
    _, checks = run_doctor(capsys, "--no-probe")
    row = checks["network isolation"]
    if not networks.isolation_problems():     # root with nft and iproute2, as in CI
        assert row["status"] == "ok" and "one namespace per sandbox" in row["detail"], row
    monkeypatch.setenv("AENV_VM__ISOLATION", "off")
    _, checks = run_doctor(capsys, "--no-probe")
    assert checks["network isolation"]["status"] == "warn" and "WITHOUT isolation" in checks["network isolation"]["detail"]
    # a host that cannot make namespaces: auto is restricted (warn), required fails
    monkeypatch.setattr(networks, "isolation_problems", lambda: ["needs root (network namespaces)"])
    monkeypatch.setenv("AENV_VM__ISOLATION", "auto")
    _, checks = run_doctor(capsys, "--no-probe")
    row = checks["network isolation"]
    assert row["status"] == "warn" and "restrict=on" in row["detail"] and "needs root" in row["detail"], row
    monkeypatch.setenv("AENV_VM__ISOLATION", "required")
    code, checks = run_doctor(capsys, "--no-probe")
    assert code == 1 and checks["network isolation"]["status"] == "fail", checks["network isolation"]


def test_doctor_reports_each_part_of_qemu_confinement(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from aenv_vm.confine import policy
    parts = {f"confine: {p}" for p in policy.PARTS}
    _, checks = run_doctor(capsys, "--no-probe")
    assert parts <= set(checks)
    if os.geteuid() == 0:    # this machine allows every part
        assert all(checks[p]["status"] == "ok" for p in parts), {p: checks[p] for p in parts}
    # a host without usable cgroups: auto warns and says why, required fails
    monkeypatch.setattr(policy, "host_layout", lambda: "no cgroup filesystem is mounted")
    _, checks = run_doctor(capsys, "--no-probe")
    assert checks["confine: cgroup"]["status"] == "warn" and "no cgroup filesystem" in checks["confine: cgroup"]["detail"]
    monkeypatch.setenv("AENV_VM__CONFINE", "required")
    code, checks = run_doctor(capsys, "--no-probe")
    assert code == 1 and checks["confine: cgroup"]["status"] == "fail"
    monkeypatch.setenv("AENV_VM__CONFINE", "off")
    _, checks = run_doctor(capsys, "--no-probe")
    assert all(checks[p]["status"] == "warn" and "confine = \"off\"" in checks[p]["detail"] for p in parts)


def test_network_auto_prefers_tap_where_the_host_allows_it() -> None:
    from aenv_vm.net.networks import decide_mode
    assert decide_mode("auto", "auto", []) == "tap"
    assert decide_mode("auto", "required", []) == "tap"
    assert decide_mode("auto", "auto", ["/dev/net/tun missing (tun module)"]) == "user"
    assert decide_mode("auto", "off", []) == "user"          # tap is always isolated: off means user
    assert decide_mode("user", "auto", []) == "user"
    assert decide_mode("tap", "auto", ["needs root"]) == "tap"   # then refused by decide_isolation


def test_doctor_names_the_mode_auto_runs_in(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from aenv_vm.net import networks
    monkeypatch.delenv("AENV_VM__NETWORK", raising=False)
    _, checks = run_doctor(capsys, "--no-probe")
    row = checks["network (configured: auto)"]
    if not networks.tap_problems():     # root with nft, iproute2 and /dev/net/tun, as in CI
        assert row["status"] == "ok" and row["detail"].endswith("tap mode in use"), row
        assert "tap networking, one namespace per sandbox" in checks["network isolation"]["detail"]
    monkeypatch.setattr(networks, "isolation_problems", lambda: ["needs root (network namespaces)"])
    _, checks = run_doctor(capsys, "--no-probe")
    assert checks["network (configured: auto)"]["status"] == "warn"
    assert "user mode in use" in checks["network (configured: auto)"]["detail"]
    assert "restrict=on" in checks["network isolation"]["detail"]
