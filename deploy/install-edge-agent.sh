#!/usr/bin/env bash
# Install the edge-gpu-relay edge agent on a GPU box as the systemd service edge-agent.
#
#   sudo deploy/install-edge-agent.sh --gateway gw.example.com:2222 --node edge-box-1 \
#        --key ./edge-box-1 --known-hosts ./known_hosts          # + ./edge-box-1-cert.pub
#
# or, with a one-time token instead of a key and certificate copied by hand (the key is
# made on this box and the certificate renewed by the agent itself):
#
#   sudo deploy/install-edge-agent.sh --gateway gw.example.com:2222 --node edge-box-1 \
#        --enroll-token ./edge-box-1.token --host-ca-fingerprint SHA256:...
#
# Run `install-edge-agent.sh --help` for every option. What it does, in order: creates the
# system user edge-gpu-relay, a virtualenv in /opt/edge-gpu-relay/venv with this package,
# /etc/edge-gpu-relay/agent.toml from the flags, installs the node key, certificate and
# known_hosts next to it, installs deploy/systemd/edge-agent.service and runs
# `systemctl daemon-reload && systemctl enable --now edge-agent`.
#
# Idempotent: every file is compared with what is there before it is written, and reported
# as "unchanged" when equal; a second run with the same flags changes nothing (it does not
# reinstall the package either: that is what --upgrade is for). A change of config, key or
# unit restarts a running agent.
set -euo pipefail

PROG=${0##*/}
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

SERVICE=edge-agent
SVC_USER=edge-gpu-relay
PACKAGE=edge-gpu-relay
# Where things go on the target system (the paths written into agent.toml and the unit).
OPT_DIR=/opt/edge-gpu-relay
VENV_DIR=$OPT_DIR/venv
ETC_DIR=/etc/edge-gpu-relay
STATE_DIR=/var/lib/edge-gpu-relay
UNIT_DIR=/etc/systemd/system
CONFIG=$ETC_DIR/agent.toml
KEY=$ETC_DIR/node.key
CERT=$ETC_DIR/node.key-cert.pub # the agent's default: <key>-cert.pub
KNOWN_HOSTS=$ETC_DIR/known_hosts
# With --enroll-token the key and certificate live in the state directory instead: the
# agent renews the certificate itself, and /etc is read-only to it (ProtectSystem=strict).
ENROLLED_KEY=$STATE_DIR/node.key
NODE_NAME_RE='^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$' # DNS-1123 label: the certificate principal

usage() {
    cat <<EOF
Usage: $PROG [options]                  install or update the agent (as root)
       $PROG --upgrade [--source S]     reinstall the package, keep config and keys, restart
       $PROG --uninstall [--purge]      remove it (the spool stays unless --purge)

Agent configuration (written to $CONFIG):
  --gateway HOST[:PORT]  the gateway's SSH address (port 2222 if omitted). Without it the
                         agent only serves locally (no --key/--known-hosts then).
  --key FILE             the node's private key (from \`cloud-gateway certs issue-node NODE\`)
  --cert FILE            its certificate (default: FILE-cert.pub next to --key)
  --known-hosts FILE     "@cert-authority * <host CA>" (the CA directory's known_hosts)
  --enroll-token FILE    instead of --key/--cert: a one-time token from \`cloud-gateway
                         certs enroll-token NODE\`; \`edge-agent enroll\` makes the key here
                         and gets the certificate (both in $STATE_DIR; the agent renews it)
  --host-ca-fingerprint SHA256:...
                         with --enroll-token and no --known-hosts: the gateways' host CA as
                         \`certs enroll-token\` printed it; known_hosts is written from it
  --node NAME            node name = the certificate's principal (default: the hostname)
  --domain NAME          network domain reported to the gateway (default: the node name)
  --listen HOST:PORT     local /metrics, /v1/collect, /healthz (default 127.0.0.1:9400)
  --docker-group         run with group docker to name containers outside Kubernetes
                         (the Docker socket is root-equivalent: opt in knowingly)

Package:
  --source DIR|WHEEL     what pip installs (default: the repository holding this script,
                         $(dirname "$SCRIPT_DIR"))
  --pip-args "ARGS"      extra pip arguments, e.g. "--no-index --find-links /srv/wheels"
                         for an offline box
  --python PYTHON        interpreter for the venv, 3.10 or newer (default: python3;
                         JetPack 5 has 3.8: install python3.10 and pass its path)

Modes:
  --upgrade              reinstall the package into the existing venv, refresh the unit
                         file, restart; config and credentials are left as they are
  --uninstall            stop, disable and remove the unit, the venv, the config and the
                         credentials; keep the spool $STATE_DIR and the user
  --purge                with --uninstall: also remove the spool and the user
  --root DIR             install into the tree DIR (DIR/opt, DIR/etc, DIR/var/lib) without
                         touching this host's users or systemd, and without root; the user
                         is recorded in DIR/etc/sysusers.d for systemd-sysusers. For tests
                         and image builds (a venv is not relocatable: with a venv, the
                         tree only works at DIR)
  --no-venv              test/packaging aid: create no venv and install no package (a
                         marker file stands in for the venv); everything else is real
  -h, --help             this text

Exit status: 0 done, 1 a step failed, 2 bad usage or input.
EOF
}

die() { # one line, exit 2: bad usage or input
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 2
}
fail() { # one line, exit 1: a step failed
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 1
}
say() { printf '%s\n' "$*"; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }

# --- arguments ------------------------------------------------------------------------
GATEWAY="" KEY_SRC="" CERT_SRC="" KNOWN_HOSTS_SRC="" NODE="" DOMAIN="" LISTEN=""
ENROLL_TOKEN="" HOST_CA_FP=""
SOURCE="" PIP_ARGS="" PYTHON=python3 ROOT="" MODE=install PURGE=0 NO_VENV=0 DOCKER_GROUP=0
CONFIG_FLAGS=() # the configuration flags given, to refuse them with --upgrade/--uninstall
MODE_FLAGS=()

while (($#)); do
    arg=$1
    shift
    value="" has_value=0
    case $arg in
    --*=*)
        value=${arg#*=}
        arg=${arg%%=*}
        has_value=1
        ;;
    esac
    case $arg in
    --gateway | --key | --cert | --known-hosts | --node | --domain | --listen | --source | \
        --pip-args | --python | --root | --enroll-token | --host-ca-fingerprint)
        if ((!has_value)); then
            (($#)) || die "$arg needs a value (see --help)"
            value=$1
            shift
        fi
        [[ -n $value ]] || die "$arg needs a non-empty value (see --help)"
        ;;
    --upgrade | --uninstall | --purge | --no-venv | --docker-group | -h | --help)
        ((!has_value)) || die "$arg takes no value (see --help)"
        ;;
    *) die "unknown option '$arg' (see --help)" ;;
    esac
    case $arg in
    --gateway) GATEWAY=$value ;;
    --key) KEY_SRC=$value ;;
    --cert) CERT_SRC=$value ;;
    --known-hosts) KNOWN_HOSTS_SRC=$value ;;
    --enroll-token) ENROLL_TOKEN=$value ;;
    --host-ca-fingerprint) HOST_CA_FP=$value ;;
    --node) NODE=$value ;;
    --domain) DOMAIN=$value ;;
    --listen) LISTEN=$value ;;
    --source) SOURCE=$value ;;
    --pip-args) PIP_ARGS=$value ;;
    --python) PYTHON=$value ;;
    --root) ROOT=$value ;;
    --upgrade) MODE=upgrade ;;
    --uninstall) MODE=uninstall ;;
    --purge) PURGE=1 ;;
    --no-venv) NO_VENV=1 ;;
    --docker-group) DOCKER_GROUP=1 ;;
    -h | --help)
        usage
        exit 0
        ;;
    esac
    case $arg in
    --gateway | --key | --cert | --known-hosts | --node | --domain | --listen | --docker-group | \
        --enroll-token | --host-ca-fingerprint)
        CONFIG_FLAGS+=("$arg")
        ;;
    --upgrade | --uninstall) MODE_FLAGS+=("$arg") ;;
    esac
done

((${#MODE_FLAGS[@]} <= 1)) || die "--upgrade and --uninstall exclude each other"
((!PURGE)) || [[ $MODE == uninstall ]] || die "--purge only goes with --uninstall"
if [[ $MODE != install ]] && ((${#CONFIG_FLAGS[@]})); then
    die "--$MODE keeps the installed configuration, so ${CONFIG_FLAGS[0]} is not accepted; run without --$MODE to change it"
fi
if [[ $MODE == uninstall ]] && [[ -n $SOURCE$PIP_ARGS ]]; then
    die "--uninstall takes no --source or --pip-args"
fi

# --- where: the host, or a tree under --root ------------------------------------------------
if [[ -n $ROOT ]]; then
    if [[ $MODE == install ]]; then
        mkdir -p -- "$ROOT" 2>/dev/null || die "--root $ROOT cannot be created"
    fi
    [[ -d $ROOT ]] || die "--root $ROOT is not a directory"
    ROOT=$(cd -- "$ROOT" && pwd -P)
    [[ $ROOT != / ]] || die "--root / is the host itself: leave --root out"
elif ((EUID != 0)); then
    die "must run as root (sudo $PROG ...), or with --root DIR to install into a directory tree"
fi
R=$ROOT # prefix for every path this script touches

# systemd actions happen only on the host, and only when systemd is PID 1 there.
SYSTEMD=0
if [[ -z $ROOT ]] && [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
    SYSTEMD=1
fi

WORK=$(mktemp -d)
trap 'rm -rf -- "$WORK"' EXIT

# --- file helpers -----------------------------------------------------------------------
CHANGED=0      # things created, written, fixed or removed in this run
UNIT_CHANGED=0 # the unit or a drop-in changed: systemctl daemon-reload

# OWNER is "user:group". Ownership is managed on the host only, never in --root mode (the
# users do not exist there, and the script need not run as root).
owner_ok() { # PATH OWNER
    [[ -z $2 || -n $ROOT ]] && return 0
    [[ $(stat -c %U:%G -- "$1") == "$2" ]]
}
set_owner() { # PATH OWNER
    [[ -z $2 || -n $ROOT ]] && return 0
    chown -- "$2" "$1"
}

# install_file SRC DEST MODE [OWNER]: write DEST only if its content, mode or owner differ.
# The new content goes to a temporary file in DEST's directory (created 0600, so a secret is
# never readable by others, even for a moment), gets its mode and owner, and is renamed
# over DEST.
install_file() {
    local src=$1 dest=$2 mode=$3 owner=${4:-} tmp state
    if [[ -f $dest && ! -L $dest ]] && cmp -s -- "$src" "$dest"; then
        if [[ $(stat -c %a -- "$dest") == "${mode#0}" ]] && owner_ok "$dest" "$owner"; then
            say "unchanged  $dest"
            return 0
        fi
        chmod -- "$mode" "$dest"
        set_owner "$dest" "$owner"
        say "fixed      $dest (mode $mode${owner:+, owner $owner})"
        CHANGED=$((CHANGED + 1))
        return 0
    fi
    state=installed
    [[ -e $dest ]] && state=updated
    tmp=$(mktemp -- "$(dirname -- "$dest")/.${dest##*/}.XXXXXX")
    cat -- "$src" >"$tmp"
    chmod -- "$mode" "$tmp"
    set_owner "$tmp" "$owner"
    mv -f -- "$tmp" "$dest"
    say "$(printf '%-10s' "$state") $dest"
    CHANGED=$((CHANGED + 1))
}

# install_text DEST MODE [OWNER] < content
install_text() {
    local staged=$WORK/staged
    cat >"$staged"
    install_file "$staged" "$@"
}

ensure_dir() { # DIR MODE [OWNER]
    local dir=$1 mode=$2 owner=${3:-}
    if [[ -d $dir ]]; then
        if [[ $(stat -c %a -- "$dir") != "${mode#0}" ]] || ! owner_ok "$dir" "$owner"; then
            chmod -- "$mode" "$dir"
            set_owner "$dir" "$owner"
            say "fixed      $dir/ (mode $mode${owner:+, owner $owner})"
            CHANGED=$((CHANGED + 1))
        fi
        return 0
    fi
    mkdir -p -- "$dir"
    chmod -- "$mode" "$dir"
    set_owner "$dir" "$owner"
    say "created    $dir/"
    CHANGED=$((CHANGED + 1))
}

make_dir() { # DIR: create a system directory if missing; never change an existing one
    [[ -d $1 ]] && return 0
    mkdir -p -- "$1"
    say "created    $1/"
}

remove_path() { # PATH [what]: rm -rf with a report line
    local path=$1
    if [[ -e $path || -L $path ]]; then
        rm -rf -- "$path"
        say "removed    $path${2:+ ($2)}"
        CHANGED=$((CHANGED + 1))
    fi
}

remove_dir_if_empty() {
    local dir=$1
    [[ -d $dir ]] || return 0
    if rmdir -- "$dir" 2>/dev/null; then
        say "removed    $dir/"
    else
        say "kept       $dir/ (holds files this script did not install)"
    fi
}

# --- validation helpers ---------------------------------------------------------------------
check_host_port() { # FLAG VALUE PORT_REQUIRED
    local flag=$1 value=$2 port
    [[ $value =~ ^[^[:space:]\"\\]+$ ]] || die "$flag '$value' must look like HOST:PORT"
    if [[ $value =~ ^(.+):([0-9]+)$ ]]; then
        port=${BASH_REMATCH[2]}
        ((10#$port >= 1 && 10#$port <= 65535)) || die "$flag '$value': port must be 1..65535"
    elif (($3)) || [[ $value == *:* && $value != \[*\] ]]; then
        die "$flag '$value' must look like HOST:PORT"
    fi
}

check_readable() { # FLAG FILE
    [[ -f $2 ]] || die "$1 $2: no such file"
    [[ -r $2 ]] || die "$1 $2: not readable"
    [[ -s $2 ]] || die "$1 $2: empty file"
}

# With ssh-keygen: the certificate must be for this key and its principal must be the node
# name, or the gateway refuses the agent (principal_mismatch): better to say so now.
check_certificate() { # KEYFILE CERTFILE NODE
    local listing principals key_fp cert_fp
    if ! command -v ssh-keygen >/dev/null; then
        say "skipped    certificate checks (ssh-keygen not found)"
        return 0
    fi
    listing=$(ssh-keygen -L -f "$2" 2>/dev/null) || die "--cert $2 is not an OpenSSH certificate (ssh-keygen -L cannot read it)"
    principals=$(awk '/^[[:space:]]*Principals:/ {p = 1; next}
                      p && /^[[:space:]]*[A-Za-z ]+:/ {p = 0}
                      p {gsub(/[[:space:]]/, ""); if ($0 != "") print}' <<<"$listing")
    if [[ $principals != "$3" ]]; then
        die "certificate $2 is for principal(s) '${principals//$'\n'/ }', not node '$3': the gateway would refuse it (pass --node $(head -n1 <<<"$principals"), or issue a certificate for $3)"
    fi
    cert_fp=$(awk '/^[[:space:]]*Public key:/ {print $NF; exit}' <<<"$listing")
    # ssh-keygen refuses a private key that others can read: look at a private copy.
    install -m 0600 -- "$1" "$WORK/key"
    key_fp=$(ssh-keygen -y -P "" -f "$WORK/key" 2>/dev/null | ssh-keygen -l -f - 2>/dev/null | awk '{print $2}') ||
        die "--key $1 cannot be read by ssh-keygen (a passphrase-protected key cannot be used by the agent)"
    [[ -n $key_fp ]] || die "--key $1 cannot be read by ssh-keygen (a passphrase-protected key cannot be used by the agent)"
    [[ $key_fp == "$cert_fp" ]] || die "certificate $2 was issued for another key ($cert_fp), not --key $1 ($key_fp)"
    say "checked    certificate: principal $3, key $key_fp"
}

toml_string() { # the flag values are checked to need no escaping
    printf '"%s"' "$1"
}

# --- steps -----------------------------------------------------------------------------------
ensure_user() {
    if [[ -n $ROOT ]]; then
        # Record the user the way systemd-sysusers creates it when this tree boots, and let
        # systemd-tmpfiles give it the credential files at boot (we cannot chown here).
        make_dir "$R/etc/sysusers.d"
        install_text "$R/etc/sysusers.d/$SVC_USER.conf" 0644 <<EOF
# edge-gpu-relay edge agent (written by install-edge-agent.sh --root)
u $SVC_USER - "edge-gpu-relay edge agent" $STATE_DIR /usr/sbin/nologin
EOF
        say "skipped    creating user $SVC_USER on this host (--root): recorded in $R/etc/sysusers.d/$SVC_USER.conf"
        return 0
    fi
    if getent passwd "$SVC_USER" >/dev/null; then
        say "unchanged  user $SVC_USER"
        return 0
    fi
    command -v useradd >/dev/null || fail "useradd not found: create the system user $SVC_USER (home $STATE_DIR, no login) and run again"
    local nologin
    nologin=$(command -v nologin || echo /usr/sbin/nologin)
    useradd --system --user-group --home-dir "$STATE_DIR" --no-create-home \
        --shell "$nologin" --comment "edge-gpu-relay edge agent" "$SVC_USER" ||
        fail "useradd $SVC_USER failed"
    say "created    user $SVC_USER (system, no login, home $STATE_DIR)"
    CHANGED=$((CHANGED + 1))
}

default_source() {
    local repo
    repo=$(dirname -- "$SCRIPT_DIR")
    if ! grep -qs "^name = \"$PACKAGE\"" "$repo/pyproject.toml"; then
        die "no --source given and $repo (above this script) is not an $PACKAGE checkout: pass --source DIR|WHEEL"
    fi
    printf '%s' "$repo"
}

check_source() {
    if [[ -z $SOURCE ]]; then
        SOURCE=$(default_source)
    elif [[ -d $SOURCE ]]; then
        [[ -f $SOURCE/pyproject.toml ]] || die "--source $SOURCE: no pyproject.toml there (expected an $PACKAGE checkout)"
        SOURCE=$(cd -- "$SOURCE" && pwd -P)
    elif [[ -f $SOURCE ]]; then
        [[ $SOURCE == *.whl || $SOURCE == *.tar.gz ]] || die "--source $SOURCE: expected a directory, a .whl or a .tar.gz"
        SOURCE=$(cd -- "$(dirname -- "$SOURCE")" && pwd -P)/${SOURCE##*/}
    else
        die "--source $SOURCE: no such file or directory"
    fi
}

check_python() {
    local home
    command -v "$PYTHON" >/dev/null || die "--python $PYTHON: not found (the agent needs Python 3.10 or newer)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
        die "$PYTHON is Python $("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])'); the agent needs 3.10 or newer (--python PATH; on a Jetson with JetPack 5, Ubuntu 20.04: apt-get install python3.10 python3.10-venv from the deadsnakes PPA, then --python /usr/bin/python3.10; JetPack 6's python3 is 3.10)"
    # A venv runs its base interpreter in place. The unit has ProtectHome=yes, so an
    # interpreter under /home or /root (pyenv, a user's conda) fails with status=203/EXEC.
    home=$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.base_prefix))')
    case $home/ in
    /home/* | /root/* | /run/user/*)
        die "$PYTHON lives in $home, which the service cannot see (ProtectHome=yes): pass --python with a system interpreter, e.g. --python /usr/bin/python3"
        ;;
    *) ;;
    esac
}

installed_version() { # prints the installed package version, or fails
    "$R$VENV_DIR/bin/python" -I - "$PACKAGE" 2>/dev/null <<'EOF'
import importlib.metadata, sys
print(importlib.metadata.version(sys.argv[1]))
EOF
}

pip_install() { # extra pip arguments...
    local pip_argv=()
    [[ -z $PIP_ARGS ]] || read -r -a pip_argv <<<"$PIP_ARGS"
    say "pip        install $* ${pip_argv[*]} $SOURCE"
    "$R$VENV_DIR/bin/python" -I -m pip install --disable-pip-version-check --quiet \
        "$@" "${pip_argv[@]}" "$SOURCE" ||
        fail "pip install of $SOURCE into $R$VENV_DIR failed (see above; an offline box needs --pip-args \"--no-index --find-links DIR\")"
}

ensure_package() { # upgrade=0|1
    local upgrade=$1 version
    ensure_dir "$R$OPT_DIR" 0755
    if ((NO_VENV)); then
        ensure_dir "$R$VENV_DIR" 0755
        install_text "$R$VENV_DIR/NO-VENV" 0644 <<EOF
install-edge-agent.sh --no-venv (a test/packaging aid): no Python environment and no package
were installed here. The unit runs $VENV_DIR/bin/edge-agent: create this venv and
pip-install edge-gpu-relay into it before starting edge-agent.
EOF
        return 0
    fi
    if [[ ! -x $R$VENV_DIR/bin/python ]]; then
        "$PYTHON" -m venv "$R$VENV_DIR" >"$WORK/venv.log" 2>&1 ||
            fail "$PYTHON -m venv $R$VENV_DIR failed: $(tail -n1 "$WORK/venv.log") (Debian/Ubuntu: apt-get install python3-venv)"
        say "created    $R$VENV_DIR (venv, $("$R$VENV_DIR/bin/python" -V 2>&1))"
        CHANGED=$((CHANGED + 1))
    fi
    if ((upgrade)); then
        # New dependencies first, then the package itself even if its version is unchanged.
        pip_install --upgrade
        pip_install --force-reinstall --no-deps
        version=$(installed_version) || fail "the package is not importable from $R$VENV_DIR after pip install"
        say "upgraded   $PACKAGE $version in $R$VENV_DIR"
        CHANGED=$((CHANGED + 1))
    elif version=$(installed_version); then
        say "unchanged  $PACKAGE $version in $R$VENV_DIR (--upgrade reinstalls it)"
    else
        pip_install
        version=$(installed_version) || fail "the package is not importable from $R$VENV_DIR after pip install"
        say "installed  $PACKAGE $version in $R$VENV_DIR"
        CHANGED=$((CHANGED + 1))
    fi
}

render_config() {
    cat <<EOF
# Written by install-edge-agent.sh. Running it again with other flags rewrites this file
# (the previous one is kept as agent.toml.bak). For settings it has no flag for, prefer a
# systemd drop-in with EDGE_AGENT_* variables, which survives: \`systemctl edit edge-agent\`,
# e.g. Environment=EDGE_AGENT_INTERVAL_SECONDS=15 (then raise WatchdogSec to 6x that too).
# Every key: README, "Configuration".
node_name = $(toml_string "$NODE")
listen = $(toml_string "${LISTEN:-127.0.0.1:9400}")
EOF
    [[ -z $DOMAIN ]] || printf 'domain = %s\n' "$(toml_string "$DOMAIN")"
    if [[ -n $GATEWAY ]]; then
        cat <<EOF

[gateway]
address = $(toml_string "$GATEWAY")
known_hosts = $(toml_string "$KNOWN_HOSTS")
key = $(toml_string "$KEY")   # certificate: $CERT
EOF
        if [[ -n $ENROLL_TOKEN ]]; then
            cat <<EOF
# Enrolled with a token: the agent asks the gateway for a new certificate at two thirds of
# its lifetime, over its tunnel, and writes it here (renew = false turns that off;
# renew_new_key = true makes a new key each time).
#renew = true
#renew_new_key = false
EOF
        fi
        cat <<EOF

# The spool, on by default with these values: every collection is kept in
# $STATE_DIR/spool.sqlite until the gateway acknowledges it, so a link outage
# loses nothing; replayed in order when the link returns. Size max_bytes as
# (86400 / interval_seconds) x days x record size (~11.5 bytes x series).
#[spool]
#enabled = true
#directory = "$STATE_DIR"
#max_bytes = 268435456            # 256 MiB; the oldest batches go first when full
#max_age_seconds = 86400          # the TSDB's out-of-order window must cover this
#replay_batches_per_second = 50
#max_in_flight = 64
EOF
    else
        cat <<EOF

# No gateway: this agent serves locally only. Re-run the installer with
# --gateway HOST:PORT --key FILE --known-hosts FILE to push to a gateway.
EOF
    fi
}

# The config is checked with the agent's own loader before it replaces the old one.
validate_config() {
    ((NO_VENV)) && return 0
    if ! "$R$VENV_DIR/bin/python" -I - "$1" >"$WORK/validate.log" 2>&1 <<'EOF'
import sys
from pathlib import Path
from edge_agent.config import load
load(Path(sys.argv[1]), environ={})
EOF
    then
        fail "the generated config does not load: $(tail -n1 "$WORK/validate.log")"
    fi
}

install_config() {
    local staged=$WORK/agent.toml
    render_config >"$staged"
    validate_config "$staged"
    if [[ -f $R$CONFIG ]] && ! cmp -s -- "$staged" "$R$CONFIG"; then
        install_file "$R$CONFIG" "$R$CONFIG.bak" 0640 "root:$SVC_USER"
    fi
    install_file "$staged" "$R$CONFIG" 0640 "root:$SVC_USER"
}

install_credentials() {
    local owner="$SVC_USER:$SVC_USER"
    if [[ -n $ENROLL_TOKEN ]]; then
        [[ -z $KNOWN_HOSTS_SRC ]] || install_file "$KNOWN_HOSTS_SRC" "$R$KNOWN_HOSTS" 0644 root:root
    elif [[ -n $GATEWAY ]]; then
        install_file "$KEY_SRC" "$R$KEY" 0600 "$owner"
        install_file "$CERT_SRC" "$R$CERT" 0600 "$owner"
        install_file "$KNOWN_HOSTS_SRC" "$R$KNOWN_HOSTS" 0644 root:root
    else
        local f
        for f in "$KEY" "$CERT" "$KNOWN_HOSTS"; do
            [[ ! -e $R$f ]] || say "kept       $R$f (unused without --gateway; --uninstall removes it)"
        done
    fi
    if [[ -n $ROOT ]]; then
        make_dir "$R/etc/tmpfiles.d"
        install_text "$R/etc/tmpfiles.d/$SVC_USER.conf" 0644 <<EOF
# edge-gpu-relay edge agent (written by install-edge-agent.sh --root): the owners this
# script could not set in the tree; systemd-tmpfiles applies them at boot.
d $STATE_DIR 0750 $SVC_USER $SVC_USER -
z $CONFIG 0640 root $SVC_USER -
z $KEY 0600 $SVC_USER $SVC_USER -
z $CERT 0600 $SVC_USER $SVC_USER -
EOF
    fi
}

# edge-agent enroll: the key made here, the certificate from the gateway (a token is single
# use, so an existing certificate is kept: running the installer again does not enroll
# again). In a --root tree the config's paths are the target's: the EDGE_AGENT_* variables
# point the command at the tree instead.
enroll_node() {
    [[ -n $ENROLL_TOKEN ]] || return 0
    if [[ -f $R$CERT ]]; then
        say "unchanged  $R$CERT (enrolled already; the token is not used again: remove the certificate to enroll anew)"
        return 0
    fi
    local agent=$R$VENV_DIR/bin/edge-agent fp_args=()
    if [[ ! -x $agent ]]; then
        say "skipped    enrolling ($agent is not installed, --no-venv); once it is, run:"
        say "           $VENV_DIR/bin/edge-agent enroll --config $CONFIG --token-file TOKEN${HOST_CA_FP:+ --host-ca-fingerprint $HOST_CA_FP}"
        return 0
    fi
    [[ -z $HOST_CA_FP ]] || fp_args=(--host-ca-fingerprint "$HOST_CA_FP")
    if ! EDGE_AGENT_GATEWAY_KEY=$R$KEY EDGE_AGENT_GATEWAY_KNOWN_HOSTS=$R$KNOWN_HOSTS \
        "$agent" enroll --config "$R$CONFIG" --token-file "$ENROLL_TOKEN" "${fp_args[@]}" \
        >"$WORK/enroll.log" 2>&1; then
        fail "enrolling failed: $(tail -n1 "$WORK/enroll.log")"
    fi
    sed 's/^/           /' "$WORK/enroll.log"
    set_owner "$R$KEY" "$SVC_USER:$SVC_USER"
    set_owner "$R$CERT" "$SVC_USER:$SVC_USER"
    say "enrolled   $NODE: $R$CERT"
    CHANGED=$((CHANGED + 1))
}

install_unit() {
    local src=$SCRIPT_DIR/systemd/$SERVICE.service before=$CHANGED
    [[ -f $src ]] || fail "$src not found: run the script from its place in the repository (deploy/)"
    make_dir "$R$UNIT_DIR"
    install_file "$src" "$R$UNIT_DIR/$SERVICE.service" 0644
    ((CHANGED == before)) || UNIT_CHANGED=1
}

install_dropins() {
    local dir=$R$UNIT_DIR/$SERVICE.service.d before=$CHANGED
    if ((DOCKER_GROUP)); then
        if [[ -z $ROOT ]]; then
            getent group docker >/dev/null || die "--docker-group: this host has no group docker"
        fi
        ensure_dir "$dir" 0755
        install_text "$dir/10-docker.conf" 0644 <<EOF
# Written by install-edge-agent.sh --docker-group: container names outside Kubernetes come
# from the Docker Engine API on /var/run/docker.sock, which needs group docker. That group
# is root-equivalent; re-run the installer without --docker-group to drop it.
[Service]
SupplementaryGroups=docker
EOF
    else
        remove_path "$dir/10-docker.conf" "no --docker-group"
    fi
    if is_jetson; then
        ensure_dir "$dir" 0755
        install_file "$SCRIPT_DIR/systemd/edge-agent-jetson.conf" "$dir/20-jetson.conf" 0644
    else
        remove_path "$dir/20-jetson.conf" "not a Jetson"
    fi
    [[ ! -d $dir ]] || rmdir -- "$dir" 2>/dev/null || true
    ((CHANGED == before)) || UNIT_CHANGED=1
}

# An NVIDIA Jetson (L4T): its GPU is read from the kernel's files, not NVML (docs/jetson.md)
is_jetson() {
    [[ -f $R/etc/nv_tegra_release ]]
}

# NVML opens /dev/nvidiactl and /dev/nvidiaN read-write; say early if the service user will
# not be able to (the unit gives it group video only).
check_devices() {
    [[ -z $ROOT ]] || return 0
    if is_jetson; then
        say "jetson     $(head -n1 /etc/nv_tegra_release | cut -c1-60): the GPU is read from sysfs (docs/jetson.md), no /dev/nvidia* needed"
        return 0
    fi
    if [[ ! -e /dev/nvidiactl ]]; then
        warn "/dev/nvidiactl does not exist: the NVIDIA driver is not loaded (does nvidia-smi work?); the agent cannot start until it is"
        return 0
    fi
    local mode group
    mode=$(stat -c %a /dev/nvidiactl)
    group=$(stat -c %G /dev/nvidiactl)
    if (((8#$mode & 8#006) == 8#006)); then
        return 0 # rw for everyone: the driver's default
    fi
    if [[ $group != video ]] || (((8#$mode & 8#060) != 8#060)); then
        warn "/dev/nvidiactl is mode $mode group $group: the agent (user $SVC_USER, group video) cannot open it; add SupplementaryGroups=$group in a drop-in (systemctl edit $SERVICE)"
    fi
}

systemd_start() {
    if ((!SYSTEMD)); then
        if [[ -n $ROOT ]]; then
            say "skipped    systemctl (--root): in the booted tree run: systemctl enable --now $SERVICE"
        else
            say "skipped    systemctl: systemd is not running here; once it is: systemctl daemon-reload && systemctl enable --now $SERVICE"
        fi
        return 0
    fi
    if ((UNIT_CHANGED)); then
        systemctl daemon-reload
        say "reloaded   systemd (daemon-reload)"
    fi
    if ((CHANGED)) && systemctl -q is-active "$SERVICE"; then
        systemctl restart "$SERVICE" || start_failed
        say "restarted  $SERVICE (its files changed)"
    fi
    local was_enabled=1 was_active=1
    systemctl -q is-enabled "$SERVICE" 2>/dev/null || was_enabled=0
    systemctl -q is-active "$SERVICE" || was_active=0
    # Type=notify: this returns once the agent has sent READY=1 (or has failed).
    systemctl enable --now --quiet "$SERVICE" || start_failed
    ((was_enabled)) || say "enabled    $SERVICE (starts at boot)"
    ((was_active)) || say "started    $SERVICE"
}

start_failed() {
    printf '%s\n' "--- journalctl -u $SERVICE -n 20 ---" >&2
    journalctl -u "$SERVICE" -n 20 --no-pager >&2 || true
    fail "$SERVICE did not start: see systemctl status $SERVICE and journalctl -u $SERVICE"
}

next_steps() {
    local host=${LISTEN%:*} port=${LISTEN##*:}
    [[ -n $LISTEN ]] || { host=127.0.0.1 port=9400; }
    [[ $host != 0.0.0.0 && $host != '[::]' && -n $host ]] || host=127.0.0.1
    cat <<EOF

Check it:
  systemctl status $SERVICE          # active (running)
  journalctl -u $SERVICE -f          # one line per record, each with node=$NODE
  curl -s $host:$port/healthz
EOF
    if [[ -n $GATEWAY ]]; then
        cat <<EOF
  on the gateway: cloud-gateway nodes     # $NODE should be listed online
EOF
    fi
}

do_install() {
    [[ -n $NODE ]] || NODE=$(uname -n)
    if ! [[ $NODE =~ $NODE_NAME_RE ]]; then
        die "node name '$NODE' is not a valid node name (a-z, 0-9, '-', 1-63 characters, starting and ending with a letter or digit); pass --node NAME, the principal of the node's certificate"
    fi
    [[ -z $DOMAIN || $DOMAIN =~ ^[^[:space:][:cntrl:]\"\\]+$ ]] || die "--domain '$DOMAIN' may not contain spaces, quotes or backslashes"
    [[ -z $LISTEN ]] || check_host_port --listen "$LISTEN" 1
    if [[ -n $ENROLL_TOKEN ]]; then
        [[ -n $GATEWAY ]] || die "--enroll-token needs --gateway HOST:PORT (the gateway to enroll with)"
        check_host_port --gateway "$GATEWAY" 0
        [[ -z $KEY_SRC$CERT_SRC ]] || die "--enroll-token makes the key here and gets the certificate: leave out --key and --cert"
        check_readable --enroll-token "$ENROLL_TOKEN"
        grep -q '^gpr1\.' "$ENROLL_TOKEN" || die "--enroll-token $ENROLL_TOKEN holds no enrollment token (from 'cloud-gateway certs enroll-token $NODE')"
        ENROLL_TOKEN=$(cd -- "$(dirname -- "$ENROLL_TOKEN")" && pwd -P)/${ENROLL_TOKEN##*/}
        if [[ -n $HOST_CA_FP ]]; then
            [[ $HOST_CA_FP =~ ^SHA256:[A-Za-z0-9+/]{43}$ ]] || die "--host-ca-fingerprint '$HOST_CA_FP' must look like SHA256:<43 base64 characters>, as 'certs enroll-token' printed it"
        elif [[ -z $KNOWN_HOSTS_SRC ]]; then
            die "--enroll-token needs --host-ca-fingerprint SHA256:... (printed by 'cloud-gateway certs enroll-token') or --known-hosts FILE, to verify the gateway before the token is sent"
        fi
        [[ -z $KNOWN_HOSTS_SRC ]] || check_readable --known-hosts "$KNOWN_HOSTS_SRC"
        KEY=$ENROLLED_KEY
        CERT=$ENROLLED_KEY-cert.pub
    elif [[ -n $HOST_CA_FP ]]; then
        die "--host-ca-fingerprint goes with --enroll-token"
    elif [[ -n $GATEWAY ]]; then
        check_host_port --gateway "$GATEWAY" 0
        [[ -n $KEY_SRC ]] || die "--gateway needs --key FILE (the node's private key from 'cloud-gateway certs issue-node $NODE')"
        [[ -n $KNOWN_HOSTS_SRC ]] || die "--gateway needs --known-hosts FILE (the fleet CA directory's known_hosts)"
        check_readable --key "$KEY_SRC"
        grep -q -- "PRIVATE KEY-----" "$KEY_SRC" || die "--key $KEY_SRC is not a private key (did you pass the .pub?)"
        if [[ -z $CERT_SRC ]]; then
            CERT_SRC=$KEY_SRC-cert.pub
            [[ -f $CERT_SRC ]] || die "certificate $CERT_SRC not found next to --key (pass --cert FILE)"
        fi
        check_readable --cert "$CERT_SRC"
        check_readable --known-hosts "$KNOWN_HOSTS_SRC"
        check_certificate "$KEY_SRC" "$CERT_SRC" "$NODE"
    elif [[ -n $KEY_SRC$CERT_SRC$KNOWN_HOSTS_SRC ]]; then
        die "--key, --cert and --known-hosts need --gateway HOST:PORT"
    fi
    if ((!NO_VENV)); then
        check_source
        [[ -x $R$VENV_DIR/bin/python ]] || check_python
    fi

    ensure_user
    ensure_package 0
    ensure_dir "$R$ETC_DIR" 0755
    install_config
    install_credentials
    ensure_dir "$R$STATE_DIR" 0750 "$SVC_USER:$SVC_USER"
    enroll_node
    install_unit
    install_dropins
    check_devices
    systemd_start
    if ((CHANGED)); then
        say "done: $CHANGED change(s)"
    else
        say "done: everything unchanged"
    fi
    [[ -n $GATEWAY ]] || say "note: no --gateway given: the agent serves locally only"
    next_steps
}

do_upgrade() {
    [[ -f $R$UNIT_DIR/$SERVICE.service ]] || fail "nothing to upgrade: $R$UNIT_DIR/$SERVICE.service is not installed (install first, without --upgrade)"
    if ((!NO_VENV)); then
        [[ -x $R$VENV_DIR/bin/python ]] || fail "nothing to upgrade: $R$VENV_DIR does not exist (install first, without --upgrade)"
        check_source
    fi
    ensure_package 1
    install_unit
    if ((SYSTEMD)); then
        ((!UNIT_CHANGED)) || systemctl daemon-reload
        systemctl restart "$SERVICE" || start_failed
        say "restarted  $SERVICE"
    elif [[ -n $ROOT ]]; then
        say "skipped    systemctl restart (--root)"
    else
        say "skipped    systemctl restart: systemd is not running here"
    fi
    say "done: upgraded"
}

do_uninstall() {
    local unit=$R$UNIT_DIR/$SERVICE.service
    if ((SYSTEMD)) && [[ -f $unit ]]; then
        systemctl disable --now --quiet "$SERVICE" || warn "systemctl disable --now $SERVICE failed; removing its files anyway"
        say "stopped    $SERVICE (and disabled)"
    fi
    remove_path "$unit"
    remove_path "$R$UNIT_DIR/$SERVICE.service.d/10-docker.conf"
    remove_path "$R$UNIT_DIR/$SERVICE.service.d/20-jetson.conf"
    remove_dir_if_empty "$R$UNIT_DIR/$SERVICE.service.d"
    if ((SYSTEMD)); then
        systemctl daemon-reload
        systemctl reset-failed "$SERVICE" 2>/dev/null || true
    fi
    remove_path "$R$VENV_DIR"
    remove_dir_if_empty "$R$OPT_DIR"
    local f
    for f in "$CONFIG" "$CONFIG.bak" "$KEY" "$CERT" "$KNOWN_HOSTS" "$ENROLLED_KEY" \
        "$ENROLLED_KEY-cert.pub" "$ENROLLED_KEY.next"; do
        remove_path "$R$f"
    done
    remove_dir_if_empty "$R$ETC_DIR"
    remove_path "$R/etc/tmpfiles.d/$SVC_USER.conf"
    if ((PURGE)); then
        remove_path "$R$STATE_DIR" "spool"
        remove_path "$R/etc/sysusers.d/$SVC_USER.conf"
        if [[ -z $ROOT ]] && getent passwd "$SVC_USER" >/dev/null; then
            userdel "$SVC_USER" || warn "userdel $SVC_USER failed"
            say "removed    user $SVC_USER"
        fi
    elif [[ -d $R$STATE_DIR ]]; then
        say "kept       $R$STATE_DIR/ (the spool; --purge removes it and the user $SVC_USER)"
    fi
    say "done: uninstalled"
}

case $MODE in
install) do_install ;;
upgrade) do_upgrade ;;
uninstall) do_uninstall ;;
esac
