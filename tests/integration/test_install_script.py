"""deploy/install-edge-agent.sh, run for real into a temporary tree (`--root`).

Most tests use `--no-venv` (the script's documented test aid: no venv, no pip) and a node
key and certificate made by the fleet PKI code; one test builds a wheel of this repository
and lets the script create a real venv and pip-install it (offline, `--no-deps`), then
`--upgrade` it. `shellcheck` runs when installed (EDGE_GPU_RELAY_REQUIRE_SHELLCHECK=1 makes
its absence a failure, as in CI).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncssh
import pytest

from edge_agent.config import load
from gpurelay.enrollment import sign_token
from harness.fleet import Pki, make_pki
from harness.services import GatewayProc
from harness.waiting import wait_until
from harness.wheel import build_wheel, copy_source
from tests.conftest import assert_shellcheck_clean

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "install-edge-agent.sh"
UNIT = REPO / "deploy" / "systemd" / "edge-agent.service"
NODE = "edge-box-1"


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGE_AGENT_")}
    env["LC_ALL"] = "C"
    return subprocess.run(
        ["bash", str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


def ok(*args: str | Path) -> str:
    proc = run(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under root -> (mode, mtime_ns, content)."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if path.is_file() else b""
        out[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, data)
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def creds(pki: Pki) -> tuple[Path, Path]:
    node = pki.node(NODE)
    assert node.private_key is not None
    return node.private_key, node.certificate


@pytest.fixture
def flags(pki: Pki, creds: tuple[Path, Path], tmp_path: Path) -> list[str | Path]:
    key, _ = creds
    return [
        "--root",
        tmp_path / "root",
        "--no-venv",
        "--gateway",
        "gw.example.com:2222",
        "--node",
        NODE,
        "--domain",
        "factory-7",
        "--key",
        key,
        "--known-hosts",
        pki.ca.known_hosts,
    ]


def test_shellcheck_clean() -> None:
    assert_shellcheck_clean(SCRIPT)


def test_help_documents_the_test_aid() -> None:
    out = ok("--help")
    assert "--no-venv" in out and "test/packaging aid" in out
    assert "--root DIR" in out


def test_installs_files_with_modes_and_a_loadable_config(
    flags: list[str | Path], creds: tuple[Path, Path], pki: Pki, tmp_path: Path
) -> None:
    out = ok(*flags)
    root = tmp_path / "root"
    etc = root / "etc" / "edge-gpu-relay"
    key, cert = creds

    assert (etc / "node.key").read_bytes() == key.read_bytes()
    assert (etc / "node.key-cert.pub").read_bytes() == cert.read_bytes()
    assert (etc / "known_hosts").read_bytes() == pki.ca.known_hosts.read_bytes()
    assert mode(etc / "node.key") == 0o600
    assert mode(etc / "node.key-cert.pub") == 0o600
    assert mode(etc / "known_hosts") == 0o644
    assert mode(etc / "agent.toml") == 0o640
    assert mode(root / "var" / "lib" / "edge-gpu-relay") == 0o750
    unit = root / "etc" / "systemd" / "system" / "edge-agent.service"
    assert unit.read_text() == UNIT.read_text()
    assert mode(unit) == 0o644
    assert (root / "opt" / "edge-gpu-relay" / "venv" / "NO-VENV").is_file()
    assert not (root / "opt" / "edge-gpu-relay" / "venv" / "bin").exists()

    # The user it would create, for systemd-sysusers; the owners for systemd-tmpfiles.
    sysusers = (root / "etc" / "sysusers.d" / "edge-gpu-relay.conf").read_text()
    assert "u edge-gpu-relay - " in sysusers and "/var/lib/edge-gpu-relay" in sysusers
    tmpfiles = (root / "etc" / "tmpfiles.d" / "edge-gpu-relay.conf").read_text()
    assert "z /etc/edge-gpu-relay/node.key 0600 edge-gpu-relay edge-gpu-relay" in tmpfiles

    # The agent's own loader accepts it; the paths are the target system's.
    cfg = load(etc / "agent.toml", environ={})
    assert cfg.node_name == NODE
    assert cfg.domain == "factory-7"
    assert cfg.listen == "127.0.0.1:9400"
    assert cfg.gateway.address == "gw.example.com:2222"
    assert cfg.gateway.key == Path("/etc/edge-gpu-relay/node.key")
    assert cfg.gateway.known_hosts == Path("/etc/edge-gpu-relay/known_hosts")
    cert_path = cfg.gateway.certificate_path
    assert cert_path is not None
    assert (root / cert_path.relative_to("/")).read_bytes() == cert.read_bytes()

    assert "skipped    systemctl (--root)" in out
    assert "journalctl -u edge-agent -f" in out
    assert "curl -s 127.0.0.1:9400/healthz" in out
    assert "cloud-gateway nodes" in out


def test_a_jetson_gets_its_drop_in_and_loses_it_when_not_one(
    flags: list[str | Path], tmp_path: Path
) -> None:
    """/etc/nv_tegra_release in the target: the unit gets 20-jetson.conf (CAP_DAC_READ_SEARCH
    for debugfs, docs/jetson.md); a later run on a tree that is not a Jetson removes it."""
    root = tmp_path / "root"
    release = root / "etc" / "nv_tegra_release"
    release.parent.mkdir(parents=True)
    release.write_text("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic\n")
    ok(*flags)
    dropin = root / "etc" / "systemd" / "system" / "edge-agent.service.d" / "20-jetson.conf"
    assert (
        dropin.read_text() == (REPO / "deploy" / "systemd" / "edge-agent-jetson.conf").read_text()
    )
    assert mode(dropin) == 0o644
    before = snapshot(root)
    ok(*flags)
    assert snapshot(root) == before  # a second run on the Jetson changes nothing
    release.unlink()
    out = ok(*flags)
    assert "20-jetson.conf (not a Jetson)" in out
    assert not dropin.parent.exists()


def test_second_run_changes_nothing(flags: list[str | Path], tmp_path: Path) -> None:
    ok(*flags)
    before = snapshot(tmp_path / "root")
    out = ok(*flags)
    assert snapshot(tmp_path / "root") == before  # contents, modes and mtimes
    assert "done: everything unchanged" in out
    lines = [line.split()[0] for line in out.splitlines() if line.startswith("/", 11)]
    assert lines and set(lines) == {"unchanged"}, out


def test_changed_flag_rewrites_config_and_keeps_the_previous(
    flags: list[str | Path], tmp_path: Path
) -> None:
    ok(*flags)
    etc = tmp_path / "root" / "etc" / "edge-gpu-relay"
    key_mtime = (etc / "node.key").stat().st_mtime_ns
    out = ok(*flags, "--listen", "0.0.0.0:9500")
    assert f"updated    {etc / 'agent.toml'}" in out
    assert load(etc / "agent.toml", environ={}).listen == "0.0.0.0:9500"
    assert load(etc / "agent.toml.bak", environ={}).listen == "127.0.0.1:9400"
    assert (etc / "node.key").stat().st_mtime_ns == key_mtime
    assert "curl -s 127.0.0.1:9500/healthz" in out


def test_local_only_install(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = ok("--root", root, "--no-venv", "--node", "lonely-1")
    cfg = load(root / "etc" / "edge-gpu-relay" / "agent.toml", environ={})
    assert cfg.gateway.address == ""
    assert cfg.node_name == "lonely-1"
    assert not (root / "etc" / "edge-gpu-relay" / "node.key").exists()
    assert "serves locally only" in out


def test_uninstall_keeps_the_spool_and_purge_removes_it(
    flags: list[str | Path], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    ok(*flags)
    spool = root / "var" / "lib" / "edge-gpu-relay" / "spool"
    spool.mkdir()
    (spool / "000001.batch").write_bytes(b"unacknowledged")
    # Something in /etc/edge-gpu-relay that is not the agent's (a gateway on the same box).
    (root / "etc" / "edge-gpu-relay" / "gateway.toml").write_text("")

    out = ok("--root", root, "--uninstall")
    assert not (root / "etc" / "systemd" / "system" / "edge-agent.service").exists()
    assert not (root / "opt" / "edge-gpu-relay").exists()
    for name in ("agent.toml", "node.key", "node.key-cert.pub", "known_hosts"):
        assert not (root / "etc" / "edge-gpu-relay" / name).exists(), name
    assert (root / "etc" / "edge-gpu-relay" / "gateway.toml").exists()
    assert (spool / "000001.batch").read_bytes() == b"unacknowledged"
    assert (root / "etc" / "sysusers.d" / "edge-gpu-relay.conf").exists()
    assert "kept" in out and "--purge" in out

    ok("--root", root, "--uninstall", "--purge")
    assert not (root / "var" / "lib" / "edge-gpu-relay").exists()
    assert not (root / "etc" / "sysusers.d" / "edge-gpu-relay.conf").exists()


def test_upgrade_needs_an_install_and_keeps_the_config(
    flags: list[str | Path], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    proc = run("--root", root, "--no-venv", "--upgrade")
    assert proc.returncode == 1 and "nothing to upgrade" in proc.stderr
    ok(*flags)
    config = (root / "etc" / "edge-gpu-relay" / "agent.toml").read_bytes()
    out = ok("--root", root, "--no-venv", "--upgrade")
    assert "done: upgraded" in out
    assert (root / "etc" / "edge-gpu-relay" / "agent.toml").read_bytes() == config


def _bad_cases(pki: Pki, creds: tuple[Path, Path], tmp: Path) -> list[tuple[list[str], str]]:
    key, cert = creds
    kh = str(pki.ca.known_hosts)
    gw = ["--gateway", "gw:2222", "--node", NODE]
    other_name = ["--gateway", "gw:2222", "--node", "other-name"]
    other = pki.node("other-box")
    assert other.private_key is not None
    cases = [
        (["--bogus"], "unknown option '--bogus'"),
        (["--node"], "--node needs a value"),
        (["--purge"], "--purge only goes with --uninstall"),
        (["--upgrade", "--uninstall"], "exclude each other"),
        (["--upgrade", "--node", NODE], "--upgrade keeps the installed configuration"),
        (["--node", "Edge_Box"], "not a valid node name"),
        (["--node", NODE, "--key", str(key)], "need --gateway"),
        ([*gw, "--known-hosts", kh], "--gateway needs --key FILE"),
        ([*gw, "--key", str(key)], "--gateway needs --known-hosts FILE"),
        ([*gw, "--key", str(tmp / "missing"), "--known-hosts", kh], "no such file"),
        ([*gw, "--key", str(cert), "--known-hosts", kh], "is not a private key"),
        (["--gateway", "gw:ssh", "--node", NODE, "--key", str(key)], "must look like HOST:PORT"),
        (["--gateway", "gw:70000", "--node", NODE], "port must be 1..65535"),
        (["--node", NODE, "--listen", "9400"], "--listen '9400' must look like HOST:PORT"),
        (["--node", NODE, "--domain", 'a"b'], "--domain"),
        ([*gw, "--key", str(key), "--cert", str(tmp / "nope"), "--known-hosts", kh], "no such"),
    ]
    if shutil.which("ssh-keygen"):
        cases += [
            (
                [*other_name, "--key", str(key), "--known-hosts", kh],
                "is for principal(s) 'edge-box-1', not node 'other-name'",
            ),
            (
                [*gw, "--key", str(other.private_key), "--cert", str(cert), "--known-hosts", kh],
                "was issued for another key",
            ),
        ]
    return cases


def test_bad_input_gives_one_clear_error(
    pki: Pki, creds: tuple[Path, Path], tmp_path: Path
) -> None:
    for args, message in _bad_cases(pki, creds, tmp_path):
        root = tmp_path / "root"
        proc = run("--root", root, "--no-venv", *args)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert len(errors) == 1, (args, proc.stderr)
        assert errors[0].startswith("install-edge-agent.sh: error: "), errors
        assert message in errors[0], (args, errors[0])
        # Refused before anything was written.
        assert not (root / "etc").exists(), (args, proc.stdout)


def test_refuses_to_run_without_root_unless_root_dir() -> None:
    if os.geteuid() == 0:  # drop to nobody for this one run (CI runs as root)
        setpriv = shutil.which("setpriv")
        assert setpriv, "setpriv (util-linux) is needed to run the check as a non-root user"
        # nobody may not be able to read this clone (one made in a `mktemp -d` directory is
        # its owner's alone), so it runs a copy, from a directory everyone can read.
        # /tmp, not $TMPDIR: that may be private too.
        with tempfile.TemporaryDirectory(prefix="install-script-", dir="/tmp") as tmp:
            os.chmod(tmp, 0o755)
            script = Path(tmp) / SCRIPT.name
            shutil.copyfile(SCRIPT, script)
            script.chmod(0o644)
            proc = subprocess.run(
                [
                    setpriv,
                    "--reuid=65534",
                    "--regid=65534",
                    "--clear-groups",
                    "bash",
                    str(script),
                    "--node",
                    NODE,
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                cwd=tmp,
            )
    else:
        proc = run("--node", NODE)
    assert proc.returncode == 2, proc.stderr
    assert "must run as root" in proc.stderr


# --- once, with a real venv ---------------------------------------------------------------


def _system_python() -> str:
    """A Python >= 3.11 whose installation the service could see (not under /home or
    /root, which the unit's ProtectHome=yes hides: the script refuses those)."""
    candidates = [shutil.which("python3.11"), shutil.which("python3"), "/usr/bin/python3"]
    candidates.append(getattr(sys, "_base_executable", sys.executable))
    for candidate in candidates:
        if not candidate or not os.path.exists(candidate):
            continue
        probe = subprocess.run(
            [
                candidate,
                "-c",
                "import os, sys, venv, ensurepip; assert sys.version_info >= (3, 11); "
                "print(os.path.realpath(sys.base_prefix))",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        prefix = probe.stdout.strip()
        if probe.returncode == 0 and not prefix.startswith(("/home/", "/root/", "/run/user/")):
            return candidate
    msg = "no Python >= 3.11 with venv outside /home and /root on this machine"
    if os.environ.get("EDGE_GPU_RELAY_REQUIRE_SYSTEM_PYTHON") == "1":
        pytest.fail(msg + " (Debian: python3 python3-venv); required in CI")
    pytest.skip(msg)


def test_refuses_a_python_older_than_310_and_says_what_a_jetson_needs(tmp_path: Path) -> None:
    """JetPack 5's Ubuntu 20.04 has Python 3.8: the installer stops before writing
    anything and names the interpreter to install (docs/jetson.md)."""
    jetpack5 = tmp_path / "python3.8"  # answers as Ubuntu 20.04's python3 does to the check
    jetpack5.write_text(
        "#!/bin/sh\n"
        'case "$2" in\n'
        '*"sys.exit(sys.version_info"*) exit 1 ;;\n'
        '*"version_info[:2]"*) echo 3.8 ;;\n'
        "*) exit 3 ;;\n"
        "esac\n"
    )
    jetpack5.chmod(0o755)
    root = tmp_path / "root"
    proc = run("--root", root, "--node", NODE, "--python", jetpack5)
    assert proc.returncode == 2, proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert f"{jetpack5} is Python 3.8; the agent needs 3.10 or newer" in error
    assert "JetPack 5" in error and "--python /usr/bin/python3.10" in error
    assert not (root / "etc").exists()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this repository, built from a copy (the checkout stays untouched)."""
    src = copy_source(tmp_path_factory.mktemp("src"))
    return build_wheel(src, tmp_path_factory.mktemp("wheel"))


def test_real_venv_install_rerun_and_upgrade(wheel: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    args = [
        "--root",
        root,
        "--node",
        NODE,
        "--python",
        _system_python(),
        "--source",
        wheel,
        # Offline and fast: the package alone (the dependencies are not needed to check
        # the install; the config check and `--version` use the standard library only).
        "--pip-args",
        "--no-deps --no-index",
    ]
    out = ok(*args)
    venv = root / "opt" / "edge-gpu-relay" / "venv"
    assert "installed  edge-gpu-relay 0.1.0" in out
    version = subprocess.run(
        [str(venv / "bin" / "edge-agent"), "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip().startswith("edge-agent ")
    assert (venv / "bin" / "cloud-gateway").exists()

    init = next(venv.glob("lib/python3*/site-packages/edge_agent/__init__.py"))
    before = init.stat().st_mtime_ns
    out = ok(*args)
    assert "unchanged  edge-gpu-relay 0.1.0" in out and "done: everything unchanged" in out
    assert init.stat().st_mtime_ns == before

    out = ok("--root", root, "--upgrade", "--source", wheel, "--pip-args", "--no-deps --no-index")
    assert "upgraded   edge-gpu-relay 0.1.0" in out
    assert init.stat().st_mtime_ns != before  # reinstalled although the version is the same


# --- --enroll-token ----------------------------------------------------------------------------


def _token(pki: Pki, tmp_path: Path, node: str = NODE) -> Path:
    ca = asyncssh.read_private_key(str(pki.ca.user_ca))
    path = tmp_path / f"{node}.token"
    path.write_text(sign_token(ca, node, int(time.time()) + 600, os.urandom(16).hex()) + "\n")
    path.chmod(0o600)
    return path


def _host_ca(pki: Pki) -> str:
    return str(asyncssh.read_public_key(str(pki.ca.host_ca_pub)).get_fingerprint("sha256"))


def test_enroll_token_flags_need_each_other_and_clear_input(pki: Pki, tmp_path: Path) -> None:
    token, fp = _token(pki, tmp_path), _host_ca(pki)
    notoken = tmp_path / "notoken"
    notoken.write_text("not a token\n")
    gw = ("--gateway", "gw:2222", "--node", NODE)
    cases: list[tuple[tuple[str | Path, ...], str]] = [
        (("--enroll-token", token, "--host-ca-fingerprint", fp), "needs --gateway"),
        ((*gw, "--enroll-token", token), "needs --host-ca-fingerprint SHA256:"),
        ((*gw, "--enroll-token", token, "--host-ca-fingerprint", "SHA256:x"), "must look like"),
        ((*gw, "--enroll-token", notoken, "--host-ca-fingerprint", fp), "holds no enrollment"),
        ((*gw, "--enroll-token", token, "--host-ca-fingerprint", fp, "--key", token), "leave out"),
        ((*gw, "--host-ca-fingerprint", fp), "goes with --enroll-token"),
    ]
    for args, message in cases:
        root = tmp_path / "root"
        proc = run("--root", root, "--no-venv", *args)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert len(errors) == 1 and message in errors[0], (args, errors)
        assert not (root / "etc").exists(), (args, proc.stdout)


def test_enroll_token_without_the_agent_installed_writes_the_config_and_says_how(
    pki: Pki, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    fp = _host_ca(pki)
    out = ok(
        "--root", root, "--no-venv", "--gateway", "gw.example.com:2222", "--node", NODE,
        "--enroll-token", _token(pki, tmp_path), "--host-ca-fingerprint", fp,
    )  # fmt: skip
    cfg = load(root / "etc" / "edge-gpu-relay" / "agent.toml", environ={})
    # In the state directory: the agent renews the certificate there (/etc is read-only).
    assert cfg.gateway.key == Path("/var/lib/edge-gpu-relay/node.key")
    assert cfg.gateway.known_hosts == Path("/etc/edge-gpu-relay/known_hosts")
    assert cfg.gateway.renew
    assert "skipped    enrolling" in out and f"--host-ca-fingerprint {fp}" in out
    assert not (root / "etc" / "edge-gpu-relay" / "node.key").exists()
    tmpfiles = (root / "etc" / "tmpfiles.d" / "edge-gpu-relay.conf").read_text()
    assert "z /var/lib/edge-gpu-relay/node.key 0600 edge-gpu-relay" in tmpfiles


def test_enroll_token_enrolls_with_a_real_gateway_once(pki: Pki, tmp_path: Path) -> None:
    """The installer runs `edge-agent enroll` (here a venv stand-in that runs this checkout)
    against a real gateway with enrollment on; a second run keeps the certificate and does
    not spend a token; --uninstall removes the credentials and keeps the spool."""
    root = tmp_path / "root"
    agent = root / "opt" / "edge-gpu-relay" / "venv" / "bin" / "edge-agent"
    agent.parent.mkdir(parents=True)
    agent.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m edge_agent "$@"\n')
    agent.chmod(0o755)
    gateway = GatewayProc(
        pki, tmp_path, enroll={"enabled": True, "user_ca_key": str(pki.ca.user_ca)}
    )
    gateway.start()
    try:
        wait_until(gateway.ready, 60, "gateway ready", alive=[gateway])
        flags = [
            "--root", root, "--no-venv", "--gateway", f"127.0.0.1:{gateway.ssh_port}",
            "--node", NODE, "--enroll-token", _token(pki, tmp_path),
            "--host-ca-fingerprint", _host_ca(pki),
        ]  # fmt: skip
        out = ok(*flags)
        state = root / "var" / "lib" / "edge-gpu-relay"
        key, cert = state / "node.key", state / "node.key-cert.pub"
        assert f"enrolled   {NODE}: {cert}" in out and "enrolled node edge-box-1" in out
        assert mode(key) == 0o600
        enrolled = asyncssh.read_certificate(str(cert))
        assert list(enrolled.principals) == [NODE]  # type: ignore[attr-defined]
        assert enrolled.key.public_data == asyncssh.read_private_key(str(key)).public_data
        known = (root / "etc" / "edge-gpu-relay" / "known_hosts").read_text()
        assert known.split() == pki.ca.known_hosts.read_text().split()[:4]

        again = ok(*flags)
        assert "enrolled already" in again and "done: everything unchanged" in again
        assert asyncssh.read_certificate(str(cert)).public_data == enrolled.public_data

        gone = ok("--root", root, "--no-venv", "--uninstall")
        assert not key.exists() and not cert.exists() and state.is_dir(), gone
    finally:
        gateway.stop()
