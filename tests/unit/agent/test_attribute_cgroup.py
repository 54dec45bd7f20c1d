"""The pure /proc/<pid>/cgroup parser, over raw file contents of every supported layout."""

from __future__ import annotations

import pytest

from edge_agent.attribute.cgroup import HOST_CGROUP, CgroupRef, parse_cgroup, parse_cgroup_path

CID = "5dde7ce79575a55a5cac3fa75d08db2988ca778982f3cd1aaa1be50500e89a3a"
CID2 = "173939f128334165c78443e4045d3e7cee45795f3c7b3029c72b3388215bfe2e"
UID = "f69b516a-c807-11ea-b574-e8611f15cb84"
UID_ = UID.replace("-", "_")
STATIC_UID = "7e2f0a0e8d1b4c6a9f3e5d7c1b2a4f6e"  # static pods: md5 of the manifest, no dashes
USER_1000 = "/user.slice/user-1000.slice/user@1000.service"  # user 1000's systemd manager

V1_CONTROLLERS = (
    "12:pids",
    "11:hugetlb",
    "10:net_cls,net_prio",
    "9:perf_event",
    "8:cpu,cpuacct",
    "7:blkio",
    "6:freezer",
    "5:rdma",
    "4:devices",
    "3:cpuset",
    "2:memory",
    "1:name=systemd",
)


def v1(path: str, **overrides: str) -> str:
    """A v1 file with ``path`` on every hierarchy; ``overrides`` by controller name."""
    lines = []
    for hierarchy in V1_CONTROLLERS:
        controller = hierarchy.split(":", 1)[1].replace("name=", "").replace(",", "_")
        lines.append(f"{hierarchy}:{overrides.get(controller, path)}")
    return "\n".join(lines) + "\n"


def v2(path: str) -> str:
    return f"0::{path}\n"


LAYOUTS = {
    "docker cgroupfs v1": (v1(f"/docker/{CID}", rdma="/"), CID, "docker", ""),
    "docker cgroupfs v2": (v2(f"/docker/{CID}"), CID, "docker", ""),
    "docker systemd v2": (v2(f"/system.slice/docker-{CID}.scope"), CID, "docker", ""),
    "docker systemd v1": (v1(f"/system.slice/docker-{CID}.scope"), CID, "docker", ""),
    "containerd cgroupfs v1 burstable": (
        v1(f"/kubepods/burstable/pod{UID}/{CID}") + "0::/\n",
        CID,
        "",  # containerd or dockershim: the path cannot tell
        UID,
    ),
    "containerd cgroupfs v1 guaranteed": (v1(f"/kubepods/pod{UID}/{CID}"), CID, "", UID),
    "containerd cgroupfs v1 besteffort": (
        v1(f"/kubepods/besteffort/pod{UID}/{CID}"),
        CID,
        "",
        UID,
    ),
    "containerd cgroupfs v2": (v2(f"/kubepods/burstable/pod{UID}/{CID}"), CID, "", UID),
    "containerd systemd v2 burstable": (
        v2(
            "/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope"
        ),
        CID,
        "containerd",
        UID,
    ),
    "containerd systemd v2 guaranteed": (
        v2(f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope"),
        CID,
        "containerd",
        UID,
    ),
    "containerd systemd v1 besteffort": (
        v1(
            "/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"
        ),
        CID,
        "containerd",
        UID,
    ),
    "crio systemd v2": (
        v2(
            "/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope"
        ),
        CID,
        "crio",
        UID,
    ),
    "crio cgroupfs v1": (v1(f"/kubepods/besteffort/pod{UID}/crio-{CID}"), CID, "crio", UID),
    "podman rootful": (v2(f"/machine.slice/libpod-{CID}.scope"), CID, "podman", ""),
    "podman rootless": (v2(f"{USER_1000}/user.slice/libpod-{CID}.scope"), CID, "podman", ""),
    "podman rootless nested": (
        v2(f"{USER_1000}/user.slice/libpod-{CID}.scope/container"),
        CID,
        "podman",
        "",
    ),
    "podman rootless in a pod": (
        v2(f"{USER_1000}/user.slice/user-libpod_pod_{CID2}.slice/libpod-{CID}.scope/container"),
        CID,
        "podman",
        "",
    ),
    "docker rootless systemd v2": (
        v2(f"{USER_1000}/user.slice/docker-{CID}.scope"),
        CID,
        "docker",
        "",
    ),
    "docker rootless, another user": (
        v2(f"/user.slice/user-4242.slice/user@4242.service/user.slice/docker-{CID}.scope"),
        CID,
        "docker",
        "",
    ),
    "podman nested": (v2(f"/machine.slice/libpod-{CID}.scope/container"), CID, "podman", ""),
    "podman cgroupfs v1": (v1(f"/libpod_parent/libpod-{CID}"), CID, "podman", ""),
    "dockershim cgroupfs v1": (v1(f"/kubepods/burstable/pod{UID}/{CID}"), CID, "", UID),
    "dockershim systemd v1": (
        v1(
            "/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope"
        ),
        CID,
        "docker",
        UID,
    ),
    "static pod uid": (v2(f"/kubepods/burstable/pod{STATIC_UID}/{CID}"), CID, "", STATIC_UID),
    "kind node (nested docker)": (
        v2(
            f"/docker/{CID2}/kubelet.slice/kubelet-kubepods.slice/"
            "kubelet-kubepods-besteffort.slice/"
            f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"
        ),
        CID,
        "containerd",
        UID,
    ),
    "inside a cgroup namespace": (
        v2(f"/../../kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope"),
        CID,
        "containerd",
        UID,
    ),
    "nerdctl systemd v2": (v2(f"/system.slice/nerdctl-{CID}.scope"), CID, "containerd", ""),
}


# Layouts of rootless runtimes: the uid of the user whose runtime runs the container.
OWNERS = {
    "podman rootless": 1000,
    "podman rootless nested": 1000,
    "podman rootless in a pod": 1000,
    "docker rootless systemd v2": 1000,
    "docker rootless, another user": 4242,
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_container_layouts(layout: str) -> None:
    text, container_id, runtime, pod_uid = LAYOUTS[layout]
    assert parse_cgroup(text) == CgroupRef(
        container_id=container_id, runtime=runtime, pod_uid=pod_uid, owner_uid=OWNERS.get(layout)
    )


def test_a_user_session_above_a_rootful_container_is_no_owner() -> None:
    """Only ``user@<uid>.service`` names an owner, not ``user-<uid>.slice`` alone (a session
    scope holds no containers) nor a lookalike segment."""
    for path in (
        f"/user.slice/user-1000.slice/session-3.scope/docker-{CID}.scope",
        f"/system.slice/user@x.service/docker-{CID}.scope",
        f"/system.slice/xuser@1000.service/docker-{CID}.scope",
    ):
        assert parse_cgroup(v2(path)) == CgroupRef(container_id=CID, runtime="docker"), path


def test_owner_survives_the_vote_across_lines() -> None:
    rootless = f"{USER_1000}/user.slice/libpod-{CID}.scope"
    text = v1(rootless, cpuset="/", systemd=rootless) + "0::/\n"
    ref = parse_cgroup(text)
    assert ref is not None and (ref.container_id, ref.owner_uid) == (CID, 1000)


def test_seed_file_from_the_field() -> None:
    # /proc/37412/cgroup from the seed write-up (CentOS 7, Docker under kubepods, cgroupfs).
    ref = parse_cgroup(v1(f"/kubepods/burstable/pod{UID}/{CID}"))
    assert ref is not None
    assert ref.container_id[:12] == "5dde7ce79575"
    assert ref.pod_uid == UID


def test_id_on_some_lines_only_neither_first_nor_last() -> None:
    text = v1(
        f"/docker/{CID}", pids="/user.slice", rdma="/", systemd="/system.slice/docker.service"
    )
    text += "0::/\n"
    assert parse_cgroup(text) == CgroupRef(container_id=CID, runtime="docker")


def test_id_seen_on_most_lines_wins() -> None:
    text = v1(f"/docker/{CID}", cpuset=f"/docker/{CID2}")
    assert parse_cgroup(text) == CgroupRef(container_id=CID, runtime="docker")


def test_conmon_is_not_the_container() -> None:
    crio = v2(
        "/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{UID_}.slice/crio-conmon-{CID}.scope"
    )
    assert parse_cgroup(crio) == CgroupRef(pod_uid=UID)
    podman = v2(f"/machine.slice/libpod-conmon-{CID}.scope")
    assert parse_cgroup(podman) is HOST_CGROUP


HOSTS = {
    "user session v2": v2("/user.slice/user-1000.slice/session-3.scope"),
    "sshd v2": v2("/system.slice/sshd.service"),
    "root v2": v2("/"),
    "init v2": v2("/init.scope"),
    "user session v1 hybrid": v1("/user.slice/user-0.slice/session-1.scope", rdma="/") + "0::/\n",
    "docker daemon itself": v2("/system.slice/docker.service"),
    "kubepods slice, no pod": v2("/kubepods.slice/kubepods-burstable.slice"),
}


@pytest.mark.parametrize("text", HOSTS.values(), ids=HOSTS.keys())
def test_host_processes(text: str) -> None:
    assert parse_cgroup(text) is HOST_CGROUP


GARBAGE = {
    "empty": "",
    "binary": "\x00\x17\x8b garbage that is not a cgroup file\nnope\n",
    "no colons": "kubepods burstable\n",
    "relative path": "0::kubepods\n",
    "hierarchy not a number": "x:cpu:/docker/" + CID + "\n",
}


@pytest.mark.parametrize("text", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_is_unparsed(text: str) -> None:
    assert parse_cgroup(text) is None


def test_garbage_lines_among_valid_ones_are_skipped() -> None:
    assert parse_cgroup(f"junk\n0::/system.slice/docker-{CID}.scope\n") == CgroupRef(
        container_id=CID, runtime="docker"
    )


def test_uppercase_or_short_ids_are_not_containers() -> None:
    assert parse_cgroup_path(f"/docker/{CID.upper()}") is HOST_CGROUP
    assert parse_cgroup_path(f"/docker/{CID[:63]}") is HOST_CGROUP
