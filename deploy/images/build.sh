#!/usr/bin/env bash
# Build the two container images, cloud-gateway and edge-agent, as OCI archives, from Debian
# packages (debootstrap) and this repository's wheel. No base image from a registry: the
# root filesystem is a Debian minbase with python3, the venv is installed offline from
# wheels downloaded here with the versions of constraints.txt. See deploy/images/README.md.
#
#   sudo deploy/images/build.sh [--out DIR] [--cache DIR] [--arch ARCH]
#
# --arch arm64 on an amd64 machine (a Jetson's image, docs/jetson.md) runs the image's
# own binaries (debootstrap's second stage, python3, pip) through qemu-user: it needs the
# Debian packages qemu-user-static and binfmt-support, with the handler registered
# (update-binfmts --enable qemu-aarch64). The archives are then NAME-VERSION-ARCH.tar.
#
# Needs root (debootstrap and chroot), buildah, debootstrap, a Python with pip (PYTHON,
# default .venv/bin/python, else python3), and deb.debian.org and PyPI (or the mirrors in
# DEBIAN_MIRROR and pip's own configuration). Touches no global container storage: buildah
# runs with the vfs driver on a private root under the output directory, removed at exit.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$REPO/build/images}
CACHE=${EDGE_GPU_RELAY_IMAGE_CACHE:-}
SUITE=${SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
IMAGE_PREFIX=${IMAGE_PREFIX:-ghcr.io/edge-gpu-relay}
SOURCE_URL=${SOURCE_URL:-https://github.com/edge-gpu-relay/edge-gpu-relay}
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi

# Inside the images: one venv, the same path as the systemd units' install; the gateway's
# user has the uid the Kubernetes manifests run it as (runAsUser/fsGroup 65532).
VENV=/opt/edge-gpu-relay/venv
GATEWAY_UID=65532
PACKAGES=python3,python3-venv,ca-certificates

usage() {
    cat <<EOF
usage: $0 [--out DIR] [--cache DIR] [--arch ARCH]

  --out DIR    where the OCI archives go (default build/images; env OUT):
               cloud-gateway-VERSION.tar and edge-agent-VERSION.tar
  --cache DIR  keep the debootstrapped root filesystem here as a tar and reuse it
               (env EDGE_GPU_RELAY_IMAGE_CACHE; default DIR/cache of --out)
  --arch ARCH  a Debian architecture (arm64, amd64); default this machine's (env ARCH).
               Another one runs through qemu-user: qemu-user-static, binfmt-support

Environment: PYTHON (runs pip on this machine), SUITE (Debian suite, default bookworm),
DEBIAN_MIRROR, IMAGE_PREFIX (default ghcr.io/edge-gpu-relay), SOURCE_URL.
EOF
}

# As root, in a mount namespace of its own: the /proc mounted in the root filesystem (and
# debootstrap's) cannot outlive the build, even one killed with SIGKILL.
if [ "$(id -u)" = 0 ] && [ -z "${EDGE_GPU_RELAY_IMAGE_BUILD_NS:-}" ]; then
    exec unshare --mount --propagation private --fork --kill-child=SIGTERM \
        env EDGE_GPU_RELAY_IMAGE_BUILD_NS=1 bash "$0" "$@"
fi

while [ $# -gt 0 ]; do
    case $1 in
        --out) OUT=$2; shift 2 ;;
        --cache) CACHE=$2; shift 2 ;;
        --arch) ARCH=$2; shift 2 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

die() { echo "build.sh: $*" >&2; exit 1; }
in_root() { # a command inside the image's root filesystem, without this machine's environment
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 chroot "$ROOTFS" "$@"
}
step() { echo "==> $*"; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap and chroot); run it with sudo"
for tool in buildah debootstrap tar; do
    command -v "$tool" >/dev/null || die "$tool not found (Debian package $tool)"
done
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip (set PYTHON)"

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CACHE=${CACHE:-$OUT/cache}
mkdir -p "$CACHE"
WORK=$(mktemp -d "$OUT/.work.XXXXXX")
BUILDAH=(buildah --storage-driver vfs --root "$WORK/storage" --runroot "$WORK/run")
CONTAINER=""
MOUNTED=""

cleanup() {
    set +e
    if [ -n "$MOUNTED" ]; then umount -R "$MOUNTED/proc" 2>/dev/null; fi
    if [ -n "$CONTAINER" ]; then
        "${BUILDAH[@]}" umount "$CONTAINER" >/dev/null 2>&1
        "${BUILDAH[@]}" rm "$CONTAINER" >/dev/null 2>&1
    fi
    # vfs layers of a root-owned tree: buildah's own cleanup, then what is left
    "${BUILDAH[@]}" rm --all >/dev/null 2>&1
    "${BUILDAH[@]}" rmi --all --force >/dev/null 2>&1
    rm -rf "$WORK" "${base:-}.tmp"
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # the EXIT trap cleans up

started=$SECONDS
host_arch=$(dpkg --print-architecture 2>/dev/null || uname -m)
arch=${ARCH:-$host_arch}
suffix=""
if [ "$arch" != "$host_arch" ]; then
    suffix="-$arch"
    case $arch in
        arm64) qemu=aarch64 ;;
        armhf) qemu=arm ;;
        amd64) qemu=x86_64 ;;
        *) qemu=$arch ;;
    esac
    grep -qx enabled "/proc/sys/fs/binfmt_misc/qemu-$qemu" 2>/dev/null ||
        die "--arch $arch on $host_arch runs the image's binaries through qemu-user, and no qemu-$qemu handler is registered: apt-get install qemu-user-static binfmt-support, then update-binfmts --enable qemu-$qemu (binfmt_misc mounted)"
fi

# 1. The root filesystem: debootstrap minbase once, kept as a tar in the cache.
base="$CACHE/debian-$SUITE-$arch-minbase-${PACKAGES//,/-}.tar"
if [ ! -s "$base" ]; then
    step "debootstrap $SUITE ($arch) from $DEBIAN_MIRROR into $base"
    debootstrap --variant=minbase --include="$PACKAGES" --arch="$arch" \
        "$SUITE" "$WORK/rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
        { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
    rm -rf "$WORK/rootfs/var/lib/apt/lists/"* "$WORK/rootfs/var/cache/apt/"*
    tar --numeric-owner --xattrs -C "$WORK/rootfs" -cf "$base.tmp" .
    mv "$base.tmp" "$base"
    rm -rf "$WORK/rootfs"
else
    step "root filesystem from the cache: $base"
fi

CONTAINER=$("${BUILDAH[@]}" from scratch)
MOUNTED=$("${BUILDAH[@]}" mount "$CONTAINER")
ROOTFS=$MOUNTED
tar --numeric-owner --xattrs -C "$ROOTFS" -xf "$base"
mount -t proc proc "$ROOTFS/proc"

# 2. The wheels: ours, built here, and the pinned dependencies for the image's Python.
read -r pyver libc machine < <(in_root python3 -c \
    'import platform, sys; print("%d%d" % sys.version_info[:2], platform.libc_ver()[1], platform.machine())')
[ -n "${machine:-}" ] || die "python3 does not run in the root filesystem"
step "wheels for CPython $pyver, glibc $libc, $machine"
mkdir -p "$WORK/wheels"
# from a clean copy of what the wheel holds: an in-tree build would leave build/ and
# *.egg-info here, and setuptools packs modules left in an old build/lib
mkdir -p "$WORK/src"
tar -C "$REPO" --exclude=__pycache__ --exclude='*.pyc' -cf - pyproject.toml README.md \
    gpurelay edge_agent cloud_gateway | tar -C "$WORK/src" -xf -
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/wheels" "$WORK/src"
ours=$(find "$WORK/wheels" -name 'edge_gpu_relay-*.whl' -print -quit)
[ -n "$ours" ] || die "pip wheel made no edge_gpu_relay wheel"
platforms=()
glibc_minor=${libc#2.}
for ((minor = glibc_minor; minor >= 5; minor--)); do
    platforms+=(--platform "manylinux_2_${minor}_$machine")
done
platforms+=(--platform manylinux2014_"$machine" --platform manylinux2010_"$machine"
    --platform manylinux1_"$machine" --platform linux_"$machine")
"$PYTHON" -m pip download --quiet --only-binary=:all: --implementation cp \
    --python-version "$pyver" --abi "cp$pyver" --abi abi3 --abi none "${platforms[@]}" \
    --constraint "$REPO/constraints.txt" --dest "$WORK/wheels" "$ours"
cp "$REPO/constraints.txt" "$WORK/wheels/"

# 3. The venv, installed offline inside the root filesystem.
step "venv $VENV"
cp -r "$WORK/wheels" "$ROOTFS/tmp/wheels"
in_root python3 -m venv "$VENV"
in_root "$VENV/bin/python" -m pip install --quiet --no-index --no-cache-dir \
    --disable-pip-version-check --find-links /tmp/wheels \
    --constraint /tmp/wheels/constraints.txt edge-gpu-relay
# pip and setuptools came with the venv; nothing at run time needs them
in_root "$VENV/bin/python" -m pip uninstall --quiet --yes pip setuptools
version=$(in_root "$VENV/bin/cloud-gateway" --version)
version=${version##* }
ln -s "$VENV/bin/cloud-gateway" "$ROOTFS/usr/local/bin/cloud-gateway"
ln -s "$VENV/bin/edge-agent" "$ROOTFS/usr/local/bin/edge-agent"

# 4. The gateway's user (no login, no home) and the config directory both images read.
echo "cloud-gateway:x:$GATEWAY_UID:$GATEWAY_UID:cloud-gateway:/nonexistent:/usr/sbin/nologin" \
    >>"$ROOTFS/etc/passwd"
echo "cloud-gateway:x:$GATEWAY_UID:" >>"$ROOTFS/etc/group"
echo "cloud-gateway:!*:::::::" >>"$ROOTFS/etc/shadow"
mkdir -p "$ROOTFS/etc/edge-gpu-relay"

# 5. Strip what nothing reads at run time; Debian's copyright files stay.
step "strip"
umount "$ROOTFS/proc"
find "$ROOTFS/usr/share/doc" -mindepth 1 ! -name copyright ! -type d -delete
find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$ROOTFS/tmp/"* "$ROOTFS/root/.cache" "$ROOTFS/usr/share/man/"* \
    "$ROOTFS/usr/share/info/"* "$ROOTFS/usr/share/locale/"* "$ROOTFS/usr/share/lintian" \
    "$ROOTFS/var/lib/apt/lists/"* "$ROOTFS/var/cache/apt/"* "$ROOTFS/var/cache/debconf/"*-old \
    "$ROOTFS/var/log/"* "$ROOTFS/etc/resolv.conf" "$ROOTFS/etc/hostname"
"${BUILDAH[@]}" umount "$CONTAINER" >/dev/null
MOUNTED=""

# 6. Two configs on the same filesystem (one layer, shared by both images), two archives.
revision=$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && [ -n "$(git -C "$REPO" status --porcelain)" ]; then
    revision="$revision-dirty"
fi
common=(--os linux --arch "$arch" --workingdir /
    --env "PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    --env PYTHONUNBUFFERED=1
    --label "org.opencontainers.image.version=$version"
    --label "org.opencontainers.image.revision=$revision"
    --label "org.opencontainers.image.source=$SOURCE_URL"
    --label "org.opencontainers.image.licenses=Apache-2.0"
    --label "org.opencontainers.image.vendor=edge-gpu-relay"
    --label "org.opencontainers.image.base.name=debian:$SUITE (debootstrap --variant=minbase)")

commit() { # NAME: the container's current config as OUT/NAME-VERSION.tar
    local archive="$OUT/$1-$version$suffix.tar"
    rm -f "$archive"
    "${BUILDAH[@]}" commit --quiet --format oci --disable-compression=false --rm=false "$CONTAINER" \
        "oci-archive:$archive:$IMAGE_PREFIX/$1:$version" >/dev/null
    echo "$archive $(du -m "$archive" | cut -f1) MiB"
}

step "images $version ($revision)"
"${BUILDAH[@]}" config "${common[@]}" \
    --label "org.opencontainers.image.title=cloud-gateway" \
    --label "org.opencontainers.image.description=edge-gpu-relay cloud gateway: SSH :2222 from the agents, HTTP :9410 for Prometheus" \
    --user "$GATEWAY_UID:$GATEWAY_UID" --port 2222/tcp --port 9410/tcp \
    --entrypoint "[\"$VENV/bin/cloud-gateway\"]" \
    --cmd '["run", "--config", "/etc/edge-gpu-relay/gateway.toml"]' "$CONTAINER"
commit cloud-gateway

# The agent runs as root: NVML opens /dev/nvidia* and reads other users' processes, and the
# host's /proc (proc_root) shows other users' /proc/<pid> entries only to root.
"${BUILDAH[@]}" config --cmd '[]' "$CONTAINER" # else buildah warns that the old one stays
"${BUILDAH[@]}" config \
    --label "org.opencontainers.image.title=edge-agent" \
    --label "org.opencontainers.image.description=edge-gpu-relay agent: NVML metrics of a GPU node, pushed over SSH to the gateway" \
    --user 0:0 --port 9400/tcp --port 2222/tcp- --port 9410/tcp- \
    --env NVIDIA_VISIBLE_DEVICES=all --env NVIDIA_DRIVER_CAPABILITIES=utility \
    --entrypoint "[\"$VENV/bin/edge-agent\"]" \
    --cmd '["run", "--config", "/etc/edge-gpu-relay/agent.toml"]' "$CONTAINER"
commit edge-agent

step "done in $((SECONDS - started)) s"
