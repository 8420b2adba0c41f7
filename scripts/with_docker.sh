#!/usr/bin/env bash
# Run a command with a Docker daemon and the sandbox image available where that can be had:
#   scripts/with_docker.sh .venv/bin/python -m pytest
# As root on Debian it installs docker.io and debootstrap if missing, starts dockerd if no
# daemon answers (and stops, at the end, only a daemon it started), and builds the Docker
# backend's image from Debian's packages (`thundersync sandbox build-image`, cached by its
# recipe, so once per machine). Elsewhere it says why and runs the command anyway: the
# Docker tests then skip, naming the reason. Exits with the command's status.
set -uo pipefail

BIN=${BIN:-.venv/bin}
LOG_DIR=${DOCKER_LOG_DIR:-.cache/docker}
started_pid=""

say() { echo "with_docker: $*" >&2; }

daemon_answers() { command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; }

install_packages() {
	local missing=()
	command -v dockerd >/dev/null || missing+=(docker.io)
	command -v debootstrap >/dev/null || missing+=(debootstrap)
	[ ${#missing[@]} -eq 0 ] && return 0
	say "installing ${missing[*]} from Debian's packages"
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

start_daemon() {
	mkdir -p "$LOG_DIR"
	dockerd >"$LOG_DIR/dockerd.log" 2>&1 &
	started_pid=$!
	for _ in $(seq 60); do
		daemon_answers && return 0
		kill -0 "$started_pid" 2>/dev/null || break
		sleep 1
	done
	say "dockerd did not answer within 60 s (see $LOG_DIR/dockerd.log)"
	stop_daemon
	return 1
}

stop_daemon() {
	[ -n "$started_pid" ] || return 0
	kill "$started_pid" 2>/dev/null
	for _ in $(seq 30); do kill -0 "$started_pid" 2>/dev/null || break; sleep 1; done
	kill -9 "$started_pid" 2>/dev/null
	started_pid=""
}
trap stop_daemon EXIT

if daemon_answers; then
	ready=1
elif [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
	say "no Docker daemon answers and this is not root on Debian: the Docker tests skip"
	ready=0
elif install_packages && start_daemon; then
	ready=1
else
	say "could not bring up a Docker daemon: the Docker tests skip"
	ready=0
fi
if [ "$ready" = 1 ]; then
	"$BIN/thundersync" sandbox build-image >&2 || say "building the sandbox image failed: the Docker tests skip"
fi

"$@"
status=$?
stop_daemon
exit $status
