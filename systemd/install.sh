#!/usr/bin/env bash
# Install the edgespec systemd units. Idempotent: run it again after a `git pull`.
#
#   sudo systemd/install.sh [--robot | --server] [--dry-run]
#
#   --robot    edge-agent only (the robot)
#   --server   server-bridge only (the GPU server)
#              (default: both)
#   --dry-run  print what would be done and change nothing; needs no root
#
# Assumes the repository is at /opt/edgespec and its venv was built there: `make setup-robot` on the
# robot, `make setup` on the server (the units run /opt/edgespec/.venv/bin/edge-agent and .../server-bridge).
# It creates the `edgespec` system user (no login shell, home /var/lib/edge-agent; the robot install
# adds it to dialout and video), installs the units into /etc/systemd/system, copies the example
# TOML configs to /etc/edgespec/ when absent (never overwrites them), creates the 0600 env files and the
# local API's reset token (api-reset.token, 0640 root:edgespec) when absent, and runs `systemctl daemon-reload`.
# It does not enable or start anything.
set -euo pipefail

PREFIX=/opt/edgespec
ETC=/etc/edgespec
UNIT_DIR=/etc/systemd/system
USER_NAME=edgespec
USER_HOME=/var/lib/edge-agent
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

robot=0 server=0 dry_run=0
for arg in "$@"; do
    case $arg in
        --robot) robot=1 ;;
        --server) server=1 ;;
        --dry-run) dry_run=1 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "install.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
    esac
done
if (( !robot && !server )); then robot=1 server=1; fi

if (( !dry_run && EUID != 0 )); then
    echo "install.sh: must run as root (sudo $0 $*), or pass --dry-run" >&2
    exit 1
fi

# run CMD...: execute it, or print it under --dry-run.
run() {
    if (( dry_run )); then echo "would run: $*"; else echo "+ $*"; "$@"; fi
}

# install_if_changed MODE SRC DEST: copy unless DEST already has the same content and mode.
install_if_changed() {
    local mode=$1 src=$2 dest=$3
    if [[ -f $dest ]] && cmp -s "$src" "$dest" && [[ $(stat -c %a "$dest") == "${mode#0}" ]]; then
        echo "unchanged: $dest"
    else
        run install -m "$mode" "$src" "$dest"
    fi
}

# install_if_absent MODE SRC DEST: copy only when DEST does not exist (configs are the admin's).
install_if_absent() {
    local mode=$1 src=$2 dest=$3
    if [[ -e $dest ]]; then echo "keeping existing: $dest"; else run install -m "$mode" "$src" "$dest"; fi
}

# env_file DEST LINE...: create a root-only (0600) env file with these lines when it does not exist.
env_file() {
    local dest=$1; shift
    if [[ -e $dest ]]; then echo "keeping existing: $dest"; return; fi
    if (( dry_run )); then echo "would create: $dest (mode 0600, root)"; return; fi
    echo "+ create $dest (mode 0600)"
    (umask 077 && printf '%s\n' "$@" > "$dest")
    chmod 0600 "$dest"
}

# secret_file DEST: when absent, a random credential (32 hex digits) in a file that root owns and the service's
# group reads (0640): the local API's reset token.
secret_file() {
    local dest=$1
    if [[ -e $dest ]]; then echo "keeping existing: $dest"; return; fi
    if (( dry_run )); then echo "would create: $dest (mode 0640, root:$USER_NAME, a random token)"; return; fi
    echo "+ create $dest (mode 0640, root:$USER_NAME)"
    (umask 077 && od -An -tx1 -N16 /dev/urandom | tr -d ' \n' > "$dest" && echo >> "$dest")
    chgrp "$USER_NAME" "$dest"
    chmod 0640 "$dest"
}

if [[ $SRC != "$PREFIX/systemd" ]]; then
    echo "note: installing from $SRC, but the units run $PREFIX/.venv/bin/...: clone the repo to $PREFIX"
fi
# require_venv NAME SETUP: the console script the unit runs must exist (a dry run only warns).
require_venv() {
    local msg="$PREFIX/.venv/bin/$1 not found: run \`make $2\` in $PREFIX first"
    if [[ -x $PREFIX/.venv/bin/$1 ]]; then return; fi
    if (( dry_run )); then echo "warning: $msg"; else echo "install.sh: $msg" >&2; exit 1; fi
}
if (( robot )); then require_venv edge-agent setup-robot; fi
if (( server )); then require_venv server-bridge setup; fi

# 1. The service user: a system account without a login shell.
if id -u "$USER_NAME" >/dev/null 2>&1; then
    echo "user exists: $USER_NAME"
else
    nologin=$(command -v nologin || echo /usr/sbin/nologin)
    # --no-create-home: the unit's StateDirectory= creates $USER_HOME, owned by the user.
    run useradd --system --user-group --home-dir "$USER_HOME" --no-create-home --shell "$nologin" "$USER_NAME"
fi
if (( robot )); then
    # The unit grants these with SupplementaryGroups= anyway; membership also makes
    # `sudo -u edgespec ...` see the serial ports, the cameras and (video) the Jetson GPU.
    for group in dialout video; do
        if ! getent group "$group" >/dev/null; then
            echo "warning: no group $group on this machine"
        elif id -nG "$USER_NAME" 2>/dev/null | tr ' ' '\n' | grep -qx "$group"; then
            echo "already in $group: $USER_NAME"
        else
            run usermod -a -G "$group" "$USER_NAME"
        fi
    done
fi

# 2. Configs, units and secrets.
if [[ -d $ETC ]]; then echo "exists: $ETC"; else run install -d -m 0755 "$ETC"; fi
units=()
if (( robot )); then
    install_if_absent 0644 "$SRC/edge-agent.toml" "$ETC/edge-agent.toml"
    env_file "$ETC/edge-agent.env" \
        "# edge-agent secrets, read by systemd (EnvironmentFile=). Keep this file mode 0600." \
        "# The token server-bridge checks in hello: the VERIFIER_TOKEN line of the server's server-bridge.env." \
        "#VERIFIER_TOKEN="
    secret_file "$ETC/api-reset.token"  # [api] reset_token_file: a reset over the local API carries it
    install_if_changed 0644 "$SRC/edge-agent.service" "$UNIT_DIR/edge-agent.service"
    units+=(edge-agent)
fi
if (( server )); then
    install_if_absent 0644 "$SRC/server-bridge.toml" "$ETC/server-bridge.toml"
    token=""
    if [[ ! -e $ETC/server-bridge.env ]] && (( !dry_run )); then
        token=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    fi
    env_file "$ETC/server-bridge.env" \
        "# server-bridge secrets, read by systemd (EnvironmentFile=). Keep this file mode 0600." \
        "# Robots send this token in hello; copy the line into each robot's /etc/edgespec/edge-agent.env." \
        "VERIFIER_TOKEN=$token"
    install_if_changed 0644 "$SRC/server-bridge.service" "$UNIT_DIR/server-bridge.service"
    units+=(server-bridge)
fi

# 3. Let systemd see the new units (a container without systemd as PID 1 has nothing to reload).
if [[ -d /run/systemd/system ]]; then
    run systemctl daemon-reload
else
    echo "systemd is not running here: skipping systemctl daemon-reload"
fi

echo
echo "Next steps:"
if (( robot )); then
    echo "  edit $ETC/edge-agent.toml ([link] verifier and ca_file, [robot] controller) and VERIFIER_TOKEN in $ETC/edge-agent.env"
    echo "  copy the CA of the verifier's TLS certificate to $ETC/verifier-ca.pem ([link] ca_file)"
    echo "  the local API is /run/edge-agent/api.sock; a reset (releasing the e-stop) carries $ETC/api-reset.token"
fi
for unit in "${units[@]}"; do
    echo "  sudo systemctl enable --now $unit"
    echo "  journalctl -u $unit -f"
done
