"""deploy/images/build.sh, run for real: both OCI archives are built (debootstrap, buildah
with a private vfs storage), unpacked like a runtime would, and run two ways.

Without a runtime: the image's entrypoint and command, its environment and its user, in a
chroot in a private mount namespace with /proc and /dev. The gateway, its PKI made by the
image's own `cloud-gateway certs`, serves /healthz as uid 65532 on a loopback port, and the
agent image (simulated GPUs) pushes to it over SSH. With a real OCI runtime, runc: buildah
loads the gateway's archive and runs it with runc (test_gateway_image_runs_under_runc); the
agent image runs from a bundle of its unpacked archive and image config, as a node's runtime
hands it to runc, and pushes to a gateway on the host (test_agent_image_runs_under_runc).

Needs root, buildah, debootstrap, runc and deb.debian.org/PyPI (`buildah_bin` and
`runc_bin` skip without them, fail under EDGE_GPU_RELAY_REQUIRE_BUILDAH=1). The
debootstrapped root filesystem is made once per module (EDGE_GPU_RELAY_IMAGE_CACHE: a
directory kept between runs instead).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_gateway.config import GatewayConfig
from cloud_gateway.http.config import HttpConfig
from cloud_gateway.ssh.config import SshConfig
from gpurelay.version import installed_version
from harness.fleet import TOKEN as FLEET_TOKEN
from harness.fleet import make_pki
from harness.ports import free_ports
from harness.process import Process
from harness.services import GatewayProc, gateway_toml
from harness.waiting import wait_until
from tests.conftest import assert_shellcheck_clean

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "images" / "build.sh"
VENV = "/opt/edge-gpu-relay/venv"
GATEWAY_UID = 65532
TOKEN = "image-test-token"
NODE = "image-node"

# The first test builds both images (debootstrap from the Debian mirror: build.sh may take
# its 900 s); the default 600 s per test would cut that.
pytestmark = pytest.mark.timeout(1200)

# Run a command in an unpacked image: a private mount namespace (the mounts vanish with
# the process), /proc and /dev as a runtime gives them, then chroot as the image's user.
IN_IMAGE = """set -e
root=$1 user=$2; shift 2
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
exec chroot --userspec="$user" "$root" "$@"
"""


@dataclass(frozen=True)
class Image:
    archive: Path
    rootfs: Path
    manifest: dict[str, Any]
    config: dict[str, Any]  # the OCI image config's "config" object
    ref_name: str
    architecture: str = ""  # the OCI image config's

    @property
    def env(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config.get("Env", []))

    def argv(self, args: Sequence[str] | None = None) -> list[str]:
        """The process a runtime starts: entrypoint + (args or the image's command),
        as the image's user."""
        command = self.config.get("Cmd", []) if args is None else list(args)
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            IN_IMAGE,
            "sh",
            str(self.rootfs),
            self.config["User"],
            *self.config["Entrypoint"],
            *command,
        ]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


def unpack(archive: Path, dest: Path) -> Image:
    """The OCI archive's one image: its manifest and config, its layers extracted in order
    into dest/rootfs (as root, numeric owners, as a runtime's snapshotter does)."""
    layout = dest / "layout"
    layout.mkdir(parents=True)
    subprocess.run(["tar", "-xf", str(archive), "-C", str(layout)], check=True, timeout=300)

    def blob(digest: str) -> Path:
        algorithm, _, hexdigest = digest.partition(":")
        return layout / "blobs" / algorithm / hexdigest

    index = json.loads((layout / "index.json").read_text())
    [entry] = index["manifests"]
    manifest = json.loads(blob(entry["digest"]).read_text())
    config = json.loads(blob(manifest["config"]["digest"]).read_text())
    rootfs = dest / "rootfs"
    rootfs.mkdir()
    for layer in manifest["layers"]:
        subprocess.run(
            ["tar", "--numeric-owner", "-xf", str(blob(layer["digest"])), "-C", str(rootfs)],
            check=True,
            timeout=300,
        )
    shutil.rmtree(layout)
    return Image(
        archive=archive,
        rootfs=rootfs,
        manifest=manifest,
        config=config["config"],
        ref_name=entry["annotations"]["org.opencontainers.image.ref.name"],
        architecture=config.get("architecture", ""),
    )


@dataclass(frozen=True)
class Builds:
    tmp: Path
    cache: str  # the debootstrapped root filesystem, made by the first build

    def run(self, out: Path, **environ: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGE_AGENT_", "CLOUD_"))}
        env["PATH"] = f"{env.get('PATH', '')}:/usr/sbin:/sbin"  # debootstrap, chroot
        return subprocess.run(
            ["bash", str(SCRIPT), "--out", str(out), "--cache", self.cache],
            env=env | environ,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )


@pytest.fixture(scope="module")
def builds(buildah_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builds]:
    tmp = tmp_path_factory.mktemp("images")
    try:
        yield Builds(tmp, os.environ.get("EDGE_GPU_RELAY_IMAGE_CACHE") or str(tmp / "cache"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # about 1 GB: unpacked trees, archives, cache


@pytest.fixture(scope="module")
def images(builds: Builds) -> dict[str, Image]:
    out = builds.tmp / "out"
    started = time.monotonic()
    build = builds.run(out)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    print(f"build.sh: {time.monotonic() - started:.0f} s\n{build.stdout}")
    assert not list(out.glob(".work.*")), "build.sh left its work dir behind"
    version = installed_version()
    return {
        name: unpack(out / f"{name}-{version}.tar", builds.tmp / name)
        for name in ("cloud-gateway", "edge-agent")
    }


def _mounts_under(path: Path) -> list[str]:
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(str(path))
    ]


def test_a_failed_build_leaves_nothing_behind(builds: Builds, images: dict[str, Image]) -> None:
    """pip finds no index (after the root filesystem is unpacked and /proc mounted in it):
    the build fails with pip's message, and its work dir, buildah storage and mounts go."""
    out = builds.tmp / "failed"
    proc = builds.run(
        out, PIP_CONFIG_FILE="/dev/null", PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_INDEX_URL=""
    )
    assert proc.returncode != 0
    assert "==> wheels for CPython" in proc.stdout, proc.stdout + proc.stderr
    assert list(out.iterdir()) == [], "no archive, no work dir"
    assert _mounts_under(builds.tmp) == []


def test_build_script_is_shellcheck_clean() -> None:
    assert_shellcheck_clean(SCRIPT)


def _labels(image: Image) -> Mapping[str, str]:
    labels: Mapping[str, str] = image.config["Labels"]
    return labels


def test_gateway_image_config(images: dict[str, Image]) -> None:
    gateway = images["cloud-gateway"]
    version = installed_version()
    assert gateway.ref_name == f"ghcr.io/edge-gpu-relay/cloud-gateway:{version}"
    assert gateway.config["User"] == f"{GATEWAY_UID}:{GATEWAY_UID}"
    assert gateway.config["Entrypoint"] == [f"{VENV}/bin/cloud-gateway"]
    assert gateway.config["Cmd"] == ["run", "--config", "/etc/edge-gpu-relay/gateway.toml"]
    assert set(gateway.config["ExposedPorts"]) == {"2222/tcp", "9410/tcp"}
    assert gateway.env["PATH"].startswith(f"{VENV}/bin:")
    labels = _labels(gateway)
    assert labels["org.opencontainers.image.version"] == version
    assert labels["org.opencontainers.image.title"] == "cloud-gateway"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    revision = labels["org.opencontainers.image.revision"]
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", revision), revision
    known = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", revision.removesuffix("-dirty")],
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert known.returncode == 0, f"{revision} is not a commit of this repository"
    # the user exists in the image, without a login shell or a home
    passwd = (gateway.rootfs / "etc" / "passwd").read_text().splitlines()
    entry = (
        f"cloud-gateway:x:{GATEWAY_UID}:{GATEWAY_UID}:cloud-gateway:/nonexistent:/usr/sbin/nologin"
    )
    assert entry in passwd


def test_agent_image_config(images: dict[str, Image]) -> None:
    agent, gateway = images["edge-agent"], images["cloud-gateway"]
    assert agent.ref_name == f"ghcr.io/edge-gpu-relay/edge-agent:{installed_version()}"
    assert agent.config["User"] == "0:0"  # NVML and the host's /proc, see build.sh
    assert agent.config["Entrypoint"] == [f"{VENV}/bin/edge-agent"]
    assert agent.config["Cmd"] == ["run", "--config", "/etc/edge-gpu-relay/agent.toml"]
    assert set(agent.config["ExposedPorts"]) == {"9400/tcp"}
    assert agent.env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert _labels(agent)["org.opencontainers.image.title"] == "edge-agent"
    # one filesystem, one layer: a node that pulls both stores it once
    assert [layer["digest"] for layer in agent.manifest["layers"]] == [
        layer["digest"] for layer in gateway.manifest["layers"]
    ]
    assert "NVIDIA_DRIVER_CAPABILITIES" not in gateway.env


def test_images_are_stripped(images: dict[str, Image]) -> None:
    root = images["cloud-gateway"].rootfs
    assert not list((root / "usr/share/man").glob("*"))
    assert not list((root / "var/lib/apt/lists").glob("*"))
    assert not (root / "root/.cache").exists()
    site = root / "opt/edge-gpu-relay/venv/lib/python3.11/site-packages"
    assert (site / "cloud_gateway").is_dir() and not (site / "pip").exists()
    docs = [p for p in (root / "usr/share/doc").rglob("*") if p.is_file()]
    assert docs and all(p.name == "copyright" for p in docs), "Debian's copyright files stay"
    for image in images.values():
        print(f"{image.archive.name}: {image.archive.stat().st_size / 2**20:.0f} MiB")


@pytest.mark.parametrize("name", ["cloud-gateway", "edge-agent"])
def test_entrypoint_runs_as_the_image_user(images: dict[str, Image], name: str) -> None:
    proc = images[name].run("--version")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"{name} {installed_version()}"


def _in_image_process(image: Image, name: str, log: Path) -> Process:
    return Process(name, image.argv(), log, image.env)


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            real, effective, *_ = line.split()[1:]
            assert real == effective
            return int(real)
    raise AssertionError(f"no Uid line for {pid}")


def _as(image: Image, *args: str) -> str:
    proc = image.run(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _agent_toml(agent_port: int, ssh_port: int) -> str:
    """The agent image's config: NODE with two simulated GPUs (the labelled NVML simulator:
    no GPU here), its exporter on loopback ``agent_port``, pushing every second to a gateway
    on loopback ``ssh_port`` with the key, certificate and known_hosts under
    /etc/edge-gpu-relay/certs, spooling where the DaemonSet's hostPath is."""
    return f"""node_name = "{NODE}"
listen = "127.0.0.1:{agent_port}"
interval_seconds = 1.0

[simulate]
gpus = 2

[gateway]
address = "127.0.0.1:{ssh_port}"
known_hosts = "/etc/edge-gpu-relay/certs/known_hosts"
key = "/etc/edge-gpu-relay/certs/{NODE}.key"
backoff_initial_seconds = 0.2
backoff_max_seconds = 1.0

[spool]
directory = "/var/lib/edge-gpu-relay/spool"
"""


def _online_with_gpus(base: str, token: str) -> bool:
    """The gateway at ``base`` lists NODE, and only NODE, online with its two GPUs."""
    auth = {"Authorization": f"Bearer {token}"}
    nodes = httpx.get(f"{base}/api/v1/nodes", headers=auth, timeout=5).json()["nodes"]
    return [(n["name"], n["state"], n["gpu_count"]) for n in nodes] == [(NODE, "online", 2)]


def test_gateway_and_agent_images_run_together(images: dict[str, Image], tmp_path: Path) -> None:
    gateway, agent = images["cloud-gateway"], images["edge-agent"]
    # The fleet PKI, made by the gateway image's own CLI, as its user, in its /tmp.
    ca = Path("/tmp/ca")
    _as(gateway, "certs", "init-ca", "--dir", str(ca))
    _as(gateway, "certs", "issue-gateway", "localhost", "--name", "127.0.0.1", "--ca-dir", str(ca))
    _as(gateway, "certs", "issue-node", NODE, "--ca-dir", str(ca))
    ssh_port, http_port, agent_port = free_ports(3)
    config = GatewayConfig(
        drain_seconds=1.0,
        ssh=SshConfig(
            listen=f"127.0.0.1:{ssh_port}",
            host_key=ca / "gateways" / "localhost",
            user_ca=ca / "user_ca.pub",
            revocation_file=ca / "revocations",
        ),
        http=HttpConfig(listen=f"127.0.0.1:{http_port}", tokens=(TOKEN,)),
    )
    (gateway.rootfs / "etc/edge-gpu-relay/gateway.toml").write_text(gateway_toml(config))

    # The agent's files, as the DaemonSet's Secret would mount them.
    certs = agent.rootfs / "etc/edge-gpu-relay/certs"
    certs.mkdir()
    host_ca = gateway.rootfs / ca.relative_to("/")
    shutil.copy(host_ca / "known_hosts", certs / "known_hosts")
    for suffix in ("", "-cert.pub"):
        shutil.copy(host_ca / "nodes" / f"{NODE}{suffix}", certs / f"{NODE}.key{suffix}")
    (agent.rootfs / "etc/edge-gpu-relay/agent.toml").write_text(_agent_toml(agent_port, ssh_port))

    gw = _in_image_process(gateway, "cloud-gateway image", tmp_path / "gateway.log")
    ag = _in_image_process(agent, "edge-agent image", tmp_path / "agent.log")
    base = f"http://127.0.0.1:{http_port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        gw.start()
        wait_until(
            lambda: httpx.get(f"{base}/healthz", timeout=5).status_code == 200,
            90,
            "the gateway image's /healthz",
            alive=[gw],
        )
        # unshare, sh and chroot exec'd one another: the process is the gateway itself
        assert _uid_of(gw.pid) == GATEWAY_UID
        assert "cloud-gateway" in Path(f"/proc/{gw.pid}/cmdline").read_text()

        ag.start()
        wait_until(
            lambda: (
                httpx.get(f"http://127.0.0.1:{agent_port}/healthz", timeout=5).status_code == 200
            ),
            90,
            "the agent image's /healthz",
            alive=[ag, gw],
        )
        assert _uid_of(ag.pid) == 0

        wait_until(
            lambda: _online_with_gpus(base, TOKEN),
            90,
            f"{NODE} online at the gateway",
            alive=[ag, gw],
        )
        metrics = httpx.get(f"{base}/metrics", headers=auth, timeout=10).text
        assert any(
            line.startswith("DCGM_FI_DEV_GPU_UTIL{") and NODE in line
            for line in metrics.splitlines()
        ), gw.tail()
    except BaseException:
        print(gw.tail(), ag.tail(), sep="\n")
        raise
    finally:
        agent_status = ag.stop()
        gateway_status = gw.stop()
    assert gateway_status == 0, gw.tail()
    assert agent_status == 0, ag.tail()


@pytest.fixture
def runc_bin() -> Path:
    """runc (Debian package runc), the OCI runtime `buildah run` hands the container to;
    required when CI requires buildah."""
    runc = shutil.which("runc") or ("/usr/sbin/runc" if Path("/usr/sbin/runc").exists() else None)
    if runc is None:
        msg = "runc not found (Debian package runc)"
        if os.environ.get("EDGE_GPU_RELAY_REQUIRE_BUILDAH") == "1":
            pytest.fail(f"{msg}; EDGE_GPU_RELAY_REQUIRE_BUILDAH=1 makes this a failure")
        pytest.skip(msg)
    return Path(runc)


def _descendants(pid: int) -> Iterator[int]:
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            yield int(child)
            yield from _descendants(int(child))


def test_gateway_image_runs_under_runc(
    images: dict[str, Image], builds: Builds, runc_bin: Path, tmp_path: Path
) -> None:
    """A real OCI runtime: buildah loads the archive, runc runs the image's command as its
    user; the config and PKI come in on a volume (as the manifests' Secrets do), made by
    the image's own `cloud-gateway certs` in a first container."""
    gateway = images["cloud-gateway"]
    storage = builds.tmp / "runc-storage"
    buildah = [
        "buildah",
        "--storage-driver",
        "vfs",
        "--root",
        str(storage / "root"),
        "--runroot",
        str(storage / "run"),
    ]

    def ok(*args: str) -> str:
        proc = subprocess.run(
            [*buildah, *args], capture_output=True, text=True, timeout=300, check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    etc = tmp_path / "etc"
    etc.mkdir()
    os.chown(etc, GATEWAY_UID, GATEWAY_UID)  # fsGroup's job in Kubernetes
    runtime = ["--runtime", str(runc_bin), "--network", "host", "-v", f"{etc}:/etc/edge-gpu-relay"]
    try:
        container = ok("from", "--quiet", f"oci-archive:{gateway.archive}").strip()
        inspected = json.loads(ok("inspect", "--type", "container", container))
        assert inspected["OCIv1"]["config"]["User"] == f"{GATEWAY_UID}:{GATEWAY_UID}"
        assert inspected["OCIv1"]["config"]["Entrypoint"] == gateway.config["Entrypoint"]
        ident = ok(
            "run", *runtime, container, "--", "sh", "-c", "id -u; id -g; cloud-gateway --version"
        )
        assert ident.split("\n")[:3] == [
            str(GATEWAY_UID),
            str(GATEWAY_UID),
            f"cloud-gateway {installed_version()}",
        ]
        ca = "/etc/edge-gpu-relay/ca"
        ok("run", *runtime, container, "--", "cloud-gateway", "certs", "init-ca", "--dir", ca)
        ok(
            "run",
            *runtime,
            container,
            "--",
            "cloud-gateway",
            "certs",
            "issue-gateway",
            "localhost",
            "--ca-dir",
            ca,
        )
        ssh_port, http_port = free_ports(2)
        config = GatewayConfig(
            drain_seconds=1.0,
            ssh=SshConfig(
                listen=f"127.0.0.1:{ssh_port}",
                host_key=Path(ca) / "gateways" / "localhost",
                user_ca=Path(ca) / "user_ca.pub",
            ),
            http=HttpConfig(listen=f"127.0.0.1:{http_port}", tokens=(TOKEN,)),
        )
        (etc / "gateway.toml").write_text(gateway_toml(config))
        command = [*gateway.config["Entrypoint"], *gateway.config["Cmd"]]
        gw = Process(
            "cloud-gateway under runc",
            [*buildah, "run", *runtime, container, "--", *command],
            tmp_path / "gateway.log",
        )
        gw.start()
        try:
            wait_until(
                lambda: (
                    httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=5).status_code == 200
                ),
                90,
                "/healthz of the gateway under runc",
                alive=[gw],
            )
            [pid] = [
                p
                for p in _descendants(gw.pid)
                if command[0] in Path(f"/proc/{p}/cmdline").read_text().split("\0")
            ]
            assert _uid_of(pid) == GATEWAY_UID
            os.kill(pid, signal.SIGTERM)  # what the kubelet sends: drains, exits 0
            assert gw.proc is not None
            assert gw.proc.wait(timeout=60) == 0, gw.tail()
        finally:
            gw.stop()
    finally:
        subprocess.run([*buildah, "rm", "--all"], capture_output=True, timeout=120, check=False)
        subprocess.run(
            [*buildah, "rmi", "--all", "--force"], capture_output=True, timeout=120, check=False
        )
        shutil.rmtree(storage, ignore_errors=True)


def _bind(source: Path, destination: str, *, readonly: bool) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "bind",
        "source": str(source),
        "options": ["rbind", "ro" if readonly else "rw"],
    }


TMPFS = {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]}


def _runc_bundle(
    runc: Path, image: Image, bundle: Path, mounts: Sequence[Mapping[str, Any]]
) -> list[str]:
    """An OCI runtime bundle in ``bundle`` for ``image``, made from the image config buildah
    wrote as a node's runtime makes one: runc's own default spec (read-only root
    filesystem, no new privileges, /proc paths masked, its own PID, mount, IPC and UTS
    namespaces) with the image's entrypoint and command, environment, user and working
    directory, every capability dropped (the DaemonSet's ``drop: ["ALL"]``), the host's
    network namespace, and ``mounts``. Returns the container's argv."""
    bundle.mkdir()
    subprocess.run([str(runc), "spec", "--bundle", str(bundle)], check=True, timeout=30)
    path = bundle / "config.json"
    spec = json.loads(path.read_text())
    uid, _, gid = image.config["User"].partition(":")
    argv = [*image.config["Entrypoint"], *image.config.get("Cmd", [])]
    process = spec["process"]
    process |= {
        "terminal": False,
        "args": argv,
        "env": image.config["Env"],
        "user": {"uid": int(uid), "gid": int(gid)},
        "cwd": image.config.get("WorkingDir") or "/",
        "capabilities": {kind: [] for kind in process["capabilities"]},
    }
    spec["root"] = {"path": str(image.rootfs), "readonly": True}
    spec["mounts"] += mounts
    linux = spec["linux"]
    linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "network"]
    path.write_text(json.dumps(spec, indent=1))
    return argv


def _mount_options(pid: int, mountpoint: str) -> list[str]:
    [options] = [
        fields[5].split(",")
        for fields in map(str.split, Path(f"/proc/{pid}/mountinfo").read_text().splitlines())
        if fields[4] == mountpoint
    ]
    return options


def test_agent_image_runs_under_runc(
    images: dict[str, Image], runc_bin: Path, tmp_path: Path
) -> None:
    """The agent image as an edge box runs it: runc, from a bundle of the unpacked archive
    and its image config (entrypoint and command, root, the image's environment), read-only
    root filesystem, no capability, config and credentials on a read-only mount, spool on
    a writable one (the DaemonSet's ConfigMap, Secret and hostPath), in the host's network
    namespace where a gateway runs on loopback. The agent (the labelled NVML simulator: no
    GPU here) connects; the gateway lists the node online and serves its GPU series under
    Hostname=NODE; SIGTERM makes the agent exit 0; the container is deleted for sure."""
    agent = images["edge-agent"]
    pki = make_pki(tmp_path)
    gw = GatewayProc(pki, tmp_path)
    conf = tmp_path / "conf"
    (conf / "certs").mkdir(parents=True)
    node = pki.node(NODE)
    assert node.private_key is not None
    shutil.copy(pki.ca.known_hosts, conf / "certs" / "known_hosts")
    shutil.copy(node.private_key, conf / "certs" / f"{NODE}.key")
    shutil.copy(node.certificate, conf / "certs" / f"{NODE}.key-cert.pub")
    (agent_port,) = free_ports(1)
    (conf / "agent.toml").write_text(_agent_toml(agent_port, gw.ssh_port))
    spool = tmp_path / "state"
    spool.mkdir()
    etc = "/etc/edge-gpu-relay"
    mounts = [
        _bind(conf, etc, readonly=True),
        _bind(spool, "/var/lib/edge-gpu-relay", readonly=False),
        TMPFS,
    ]
    argv = _runc_bundle(runc_bin, agent, tmp_path / "bundle", mounts)
    runc = [str(runc_bin), "--root", str(tmp_path / "runc")]  # its state, not /run/runc
    name = f"edge-agent-image-{os.getpid()}"
    ag = Process(
        "edge-agent under runc",
        [*runc, "run", "--bundle", str(tmp_path / "bundle"), name],
        tmp_path / "agent.log",
    )
    agent_url = f"http://127.0.0.1:{agent_port}"
    try:
        gw.start()
        wait_until(gw.ready, 60, "the gateway on the host", alive=[gw])
        ag.start()
        wait_until(
            lambda: httpx.get(f"{agent_url}/healthz", timeout=5).status_code == 200,
            90,
            "/healthz of the agent under runc",
            alive=[ag, gw],
        )
        [pid] = [
            p
            for p in _descendants(ag.pid)
            if argv[0] in Path(f"/proc/{p}/cmdline").read_text().split("\0")
        ]
        assert _uid_of(pid) == 0
        environ = Path(f"/proc/{pid}/environ").read_text().split("\0")
        assert set(agent.config["Env"]) <= set(environ), environ  # runc adds HOME
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        [cap_eff] = [line.split()[1] for line in status if line.startswith("CapEff:")]
        assert int(cap_eff, 16) == 0, "no capability"
        for ns in ("pid", "mnt"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
        assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
        assert "ro" in _mount_options(pid, etc)
        assert "ro" in _mount_options(pid, "/")
        info = [
            line
            for line in httpx.get(f"{agent_url}/metrics", timeout=5).text.splitlines()
            if line.startswith("gpurelay_agent_info{")
        ]
        assert len(info) == 1 and 'backend="simulated"' in info[0], info

        wait_until(
            lambda: _online_with_gpus(gw.url, FLEET_TOKEN),
            90,
            f"{NODE} online at the gateway",
            alive=[ag, gw],
        )
        metrics = httpx.get(
            f"{gw.url}/metrics", headers={"Authorization": f"Bearer {FLEET_TOKEN}"}, timeout=10
        ).text
        gpus = {
            sample.labels["gpu"]
            for family in text_string_to_metric_families(metrics)
            if family.name == "DCGM_FI_DEV_GPU_UTIL"
            for sample in family.samples
            if sample.labels.get("Hostname") == NODE
        }
        assert gpus == {"0", "1"}, metrics
        assert ag.stop() == 0, ag.tail()  # runc hands SIGTERM to the agent: it exits 0
    except BaseException:
        print(gw.tail(), ag.tail(), sep="\n")
        raise
    finally:
        ag.stop()
        gw.stop()
        subprocess.run(
            [*runc, "delete", "--force", name], capture_output=True, timeout=60, check=False
        )
    left = subprocess.run(
        [*runc, "list", "--quiet"], capture_output=True, text=True, timeout=30, check=True
    )
    assert left.stdout.split() == [], "the container is gone"


# --- arm64, for Jetsons (docs/jetson.md), built on this machine through qemu-user -----------

QEMU_AARCH64 = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
ELF_MACHINE_AARCH64 = 183  # e_machine of an AArch64 ELF binary


def _host_arch() -> str:
    return subprocess.run(
        ["dpkg", "--print-architecture"], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture(scope="module")
def arm64_images(builds: Builds) -> dict[str, Image]:
    """Both images for arm64 (build.sh --arch arm64): natively on an arm64 machine, else
    through qemu-user, which needs a registered qemu-aarch64 binfmt handler (skips without
    one; fails instead under EDGE_GPU_RELAY_REQUIRE_QEMU=1, as in CI)."""
    native = _host_arch() == "arm64"
    if not native:
        enabled = QEMU_AARCH64.exists() and QEMU_AARCH64.read_text().startswith("enabled")
        if not enabled:
            msg = (
                "no qemu-aarch64 binfmt handler (Debian: qemu-user-static binfmt-support, "
                "update-binfmts --enable qemu-aarch64)"
            )
            if os.environ.get("EDGE_GPU_RELAY_REQUIRE_QEMU") == "1":
                pytest.fail(msg + "; EDGE_GPU_RELAY_REQUIRE_QEMU=1 makes this a failure")
            pytest.skip(msg)
    out = builds.tmp / "out-arm64"
    started = time.monotonic()
    build = builds.run(out, ARCH="arm64")
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    print(f"build.sh --arch arm64: {time.monotonic() - started:.0f} s\n{build.stdout}")
    suffix = "" if native else "-arm64"
    version = installed_version()
    return {
        name: unpack(out / f"{name}-{version}{suffix}.tar", builds.tmp / f"{name}-arm64")
        for name in ("cloud-gateway", "edge-agent")
    }


def test_the_arm64_agent_image_collects_a_jetson(arm64_images: dict[str, Image]) -> None:
    """The image a Jetson runs (deploy/kubernetes/edge-agent-jetson.yaml): arm64 through
    and through, and its agent collects a (simulated) Orin, promtool-clean."""
    agent, gateway = arm64_images["edge-agent"], arm64_images["cloud-gateway"]
    assert agent.architecture == gateway.architecture == "arm64"
    python = agent.rootfs / "usr" / "bin" / "python3.11"
    header = python.read_bytes()[:20]
    assert header[:4] == b"\x7fELF"
    assert int.from_bytes(header[18:20], "little") == ELF_MACHINE_AARCH64
    out = agent.run("once", "--simulate", "jetson-orin", "--node-name", "orin-arm64")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SIMULATED JETSON" in out.stderr and "Traceback" not in out.stderr
    series = {f.name for f in text_string_to_metric_families(out.stdout)}
    assert {"DCGM_FI_DEV_GPU_UTIL", "gpurelay_jetson_rail_power_watts"} <= series
    assert 'backend="simulated-jetson"' in out.stdout
    version = gateway.run("--version")
    assert version.returncode == 0 and version.stdout.strip().endswith(installed_version())
