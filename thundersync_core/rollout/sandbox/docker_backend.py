"""Docker sandbox: one container per trajectory, no network, no capabilities, hard limits.

The container's main process is a shell that reaps orphans and that the agent cannot
kill from inside (see ``_MAIN``); it runs with
``network_mode="none"``, ``cap_drop=["ALL"]``, ``no-new-privileges``, ``mem_limit`` with
no extra swap, ``nano_cpus``, ``pids_limit`` and rlimits for CPU seconds, file size and
core dumps. Each ``exec`` is a Docker exec whose output is streamed (stdout and stderr
demultiplexed) into the same bounded buffers as the local backend.

Timeouts: the command runs under ``timeout -s KILL``, which leads its own process group
and kills the whole group, so children die with it; then a second exec kills every process
started since the command began (the wrapper writes its pid and start time to a file), so
a child that left the group with ``setsid`` dies too. A host-side deadline a little later
covers a wedged daemon: it runs the same kill and stops reading.

Files move as tar archives through the daemon (``put_archive``/``get_archive``), so this
works with a remote daemon too. Nothing of the container is visible on the host:
``host_workdir`` is a staging folder that ``pull_workdir`` fills with a copy on demand.

Unlike the local backend, processes the agent starts in the background survive between
execs (as in any long-lived container), and the agent is root in its container, so it can
change the image's interpreter and site-packages. ``begin_verification`` therefore either
moves the workdir into a fresh container from the image (SWE grading) or kills every
process of the container before the verifier runs (terminal tasks).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import shutil
import socket
import tarfile
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from thundersync_core.rollout.sandbox.base import (
    LOGS_DIR,
    TESTS_DIR,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxPathError,
    SandboxUnavailable,
    classify_exit,
    relative_parts,
)
from thundersync_core.rollout.sandbox.output import BoundedOutput

__all__ = ["DEFAULT_IMAGE", "DockerSandbox", "connect_docker"]

DEFAULT_IMAGE = "thundersync-sandbox:latest"
# How the default image is made on a machine without a registry (sandbox/image.py).
BUILD_IMAGE_COMMAND = "thundersync sandbox build-image"
#: Names the process that opened a sandbox container, as ``host:pid``.
OWNER_LABEL = "thundersync.owner"
_STAGING_PREFIX = "thundersync-docker-"
_swept = threading.Lock()
_swept_once: list[bool] = []
# Host-side slack past the in-container timeout before the host kills and stops reading.
_HOST_GRACE_S = 5.0
_KILL_GRACE_S = 5.0
_SETUP_TIMEOUT_S = 60.0
_CONTROL_DIR = "/tmp/.thundersync"
# $1 pid file, $2 stdin file or "", $3 timeout; the rest is the command. `timeout` calls
# setpgid(0, 0), so the pid written here is also the group id of everything it starts;
# the start time beside it (field 22 of /proc/PID/stat, in clock ticks) lets
# _KILL_TREE find what left the group (setsid). The command may have emptied /tmp, hence
# the mkdir.
_WRAPPER = (
    'p=$1; i=$2; t=$3; shift 3; mkdir -p "${p%/*}"; '
    'echo $$ "$(cut -d" " -f22 /proc/$$/stat)" > "$p"; '
    'if [ -n "$i" ]; then exec < "$i"; rm -f "$i"; else exec < /dev/null; fi; '
    'exec timeout -s KILL "$t" "$@"'
)
# A timed-out command's whole tree: its process group, then every process started since
# the command began except the container's init and this script (one sandbox runs one
# command at a time, so those are all the command's).
_KILL_TREE = (
    'read g t < "$1" || exit 0; kill -KILL -- "-$g" 2>/dev/null; '
    "for d in /proc/[0-9]*; do q=${d#/proc/}; "
    '[ "$q" = 1 ] || [ "$q" = $$ ] && continue; '
    'l=$(cat "$d/stat" 2>/dev/null) || continue; set -- ${l##*) }; '
    '[ "${20:-0}" -ge "$t" ] && kill -KILL "$q" 2>/dev/null; done; true'
)
# The container's main process, its pid 1. The kernel drops signals sent to a pid
# namespace's init from inside the namespace unless it handles them, so the agent (root
# in its container) cannot end it with `kill -9 1`; what it can kill is the `sleep`, which
# comes back. `wait` reaps every child, orphans included (pid 1 adopts them), so finished
# background processes do not pile up against the pid limit. If it ends all the same (an
# out-of-memory kill), the next call starts the container again (`_while_running`).
_MAIN = 'trap "" HUP INT QUIT TERM USR1 USR2; while :; do sleep 3600 & wait; done'
_OOM_KILL = re.compile(rb"^oom_kill (\d+)$", re.MULTILINE)
_SIGKILL_STATUS = 137
_TIMEOUT_STATUSES = (124, _SIGKILL_STATUS)
_T = TypeVar("_T")


def _stopped(exc: Any) -> bool:
    """Whether the daemon refused a call because the container is not running."""
    return exc.status_code == 409 or "is not running" in str(exc)


def connect_docker() -> Any:
    """A Docker client whose daemon answers a ping, or SandboxUnavailable saying why not."""
    import docker  # noqa: PLC0415 (optional dependency: only the Docker backend needs it)

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        raise SandboxUnavailable(f"no Docker daemon answers: {exc}") from exc
    return client


def remove_abandoned_sandboxes(client: Any) -> list[str]:
    """Remove the sandbox containers (with their volumes) and staging folders of processes
    on this host that are gone: a rollout role killed mid-episode cannot close its own.
    Returns the names of the containers removed."""
    from thundersync_core.rollout.weights import process_alive  # noqa: PLC0415

    host = socket.gethostname()
    removed = []
    for container in client.containers.list(all=True, filters={"label": OWNER_LABEL}):
        owner_host, _, pid = container.labels.get(OWNER_LABEL, "").rpartition(":")
        if owner_host == host and pid.isdigit() and not process_alive(int(pid)):
            _close_container(container, None)
            removed.append(container.name)
    for staging in Path(tempfile.gettempdir()).glob(f"{_STAGING_PREFIX}*-*"):
        pid = staging.name.removeprefix(_STAGING_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)
    return removed


def _sweep_once(client: Any) -> None:
    with _swept:
        if not _swept_once:
            _swept_once.append(True)
            remove_abandoned_sandboxes(client)


def _close_container(container: Any, staging: Path | None) -> None:
    import docker  # noqa: PLC0415

    with contextlib.suppress(docker.errors.NotFound):
        container.remove(force=True, v=True)
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


class DockerSandbox(Sandbox):
    """One container per trajectory; removed on close.

    ``python`` is the interpreter graders run; by default the image's ``python3``, its path
    looked up when the container starts, before the agent can run anything.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        image: str = DEFAULT_IMAGE,
        workdir: str = "/app",
        ro_binds: Sequence[Path] = (),
        workdir_from: Path | None = None,
        client: Any = None,
        python: str | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        if not PurePosixPath(workdir).is_absolute() or workdir == "/":
            raise SandboxPathError(f"workdir {workdir!r} must be an absolute path below /")
        self.workdir = workdir
        self.image = image
        self.python = python or "python3"
        self._ro_binds = tuple(ro_binds)
        self._client = client or connect_docker()
        _sweep_once(self._client)
        self._staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{os.getpid()}-"))
        self.host_workdir = self._staging / PurePosixPath(workdir).name
        self._container = self._start()
        self._finalizer = weakref.finalize(self, _close_container, self._container, self._staging)
        self._oom_kills: int | None = None
        try:
            self._prepare_container()
            if workdir_from is not None:
                self.copy_in(workdir_from)
        except BaseException:
            self.close()
            raise

    def _prepare_container(self) -> None:
        self._run_checked(["mkdir", "-p", LOGS_DIR, TESTS_DIR, _CONTROL_DIR, self.workdir])
        self._oom_kills = self._read_oom_kills()
        if self.python == "python3":
            # Graders' interpreter: the image's own, found before the agent ran anything.
            found = self.exec(["sh", "-c", "command -v python3"], timeout_s=_SETUP_TIMEOUT_S)
            if found.exit_code == 0 and found.stdout.strip().startswith("/"):
                self.python = found.stdout.strip()

    def _start(self) -> Any:
        import docker  # noqa: PLC0415

        limits = self.limits
        file_bytes = limits.max_file_mb << 20
        ulimits = [
            docker.types.Ulimit(name="cpu", soft=limits.cpu_s, hard=limits.cpu_s + 1),
            docker.types.Ulimit(name="fsize", soft=file_bytes, hard=file_bytes),
            docker.types.Ulimit(name="core", soft=0, hard=0),
        ]
        volumes = {str(p): {"bind": str(p), "mode": "ro"} for p in self._ro_binds}
        try:
            # Looked up first: `containers.run` would try to pull a missing image.
            self._client.images.get(self.image)
            return self._client.containers.run(
                self.image,
                command=["/bin/sh", "-c", _MAIN],
                detach=True,
                working_dir=self.workdir,
                network_mode="none",
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                mem_limit=f"{limits.memory_mb}m",
                memswap_limit=f"{limits.memory_mb}m",
                nano_cpus=int(limits.cpus * 1e9),
                pids_limit=limits.max_processes,
                ulimits=ulimits,
                volumes=volumes,
                labels={
                    "thundersync.sandbox": "1",
                    OWNER_LABEL: f"{socket.gethostname()}:{os.getpid()}",
                },
            )
        except docker.errors.ImageNotFound as exc:
            shutil.rmtree(self._staging, ignore_errors=True)
            raise SandboxUnavailable(
                f"Docker image {self.image!r} is not on the daemon ({exc}); nothing is pulled: "
                f"build it with `{BUILD_IMAGE_COMMAND} --tag {self.image}`"
            ) from exc
        except docker.errors.APIError as exc:
            shutil.rmtree(self._staging, ignore_errors=True)
            raise SandboxError(f"could not start a container from {self.image!r}: {exc}") from exc

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise SandboxError(f"sandbox container {self._container.short_id} is closed")

    # -- running commands ---------------------------------------------------------------

    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
    ) -> ExecResult:
        self._check_open()
        if not isinstance(command, str) and not command:
            raise ValueError("exec: empty command")
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        token = uuid.uuid4().hex
        pid_file = f"{_CONTROL_DIR}/{token}.pid"
        stdin_file = ""
        if stdin is not None:
            stdin_file = f"{_CONTROL_DIR}/{token}.stdin"
            # Extracted at "/", which always exists; the daemon creates missing parents.
            self._put_files("/", {stdin_file.lstrip("/"): stdin.encode()})
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        # Whole seconds, rounded up: busybox's `timeout` takes no fractions.
        seconds = str(max(1, math.ceil(timeout)))
        wrapped = ["/bin/sh", "-c", _WRAPPER, "sh", pid_file, stdin_file, seconds, *argv]
        return self._run_exec(wrapped, env, timeout, pid_file)

    def _run_exec(
        self, wrapped: list[str], env: Mapping[str, str] | None, timeout: float, pid_file: str
    ) -> ExecResult:
        api = self._client.api
        start = time.monotonic()
        exec_id, stream = self._start_exec(wrapped, env)
        out = BoundedOutput(self.limits.output_bytes)
        err = BoundedOutput(self.limits.output_bytes)
        failures: list[BaseException] = []
        reader = threading.Thread(target=_consume, args=(stream, out, err, failures), daemon=True)
        reader.start()
        reader.join(timeout + _HOST_GRACE_S)
        host_killed = reader.is_alive()
        if host_killed:
            self._kill_tree(pid_file)
            reader.join(_KILL_GRACE_S)
            stream.close()
            reader.join(1.0)
        elif failures:
            raise SandboxError(f"reading the output of {wrapped[7:]} failed") from failures[0]
        duration = time.monotonic() - start
        exit_code = api.exec_inspect(exec_id).get("ExitCode")
        # `timeout` reports 124, or 137 when its SIGKILL also reached itself; a command
        # can exit so on its own, but not also at the deadline.
        timed_out = host_killed or (exit_code in _TIMEOUT_STATUSES and duration >= timeout)
        if timed_out and not host_killed:
            # `timeout` killed its group; what left the group (setsid) is still running.
            self._kill_tree(pid_file)
        return self._result(out, err, None if timed_out else exit_code, timed_out, duration)

    def _start_exec(self, wrapped: list[str], env: Mapping[str, str] | None) -> tuple[str, Any]:
        """Create and start an exec: its id and its output stream."""
        api = self._client.api

        def start() -> tuple[str, Any]:
            exec_id = api.exec_create(
                self._container.id, wrapped, environment=dict(env or {}), workdir=self.workdir
            )["Id"]
            return exec_id, api.exec_start(exec_id, stream=True, demux=True)

        return self._while_running(start, f"docker exec of {wrapped[7:]}")

    def _while_running(self, call: Callable[[], _T], what: str) -> _T:
        """``call()``; if the container stopped under it, start it again and call once more.

        A command can end the container's main process; the container then exits on its
        own a moment later, so the next exec may be refused, or accepted and then refused
        at its start (the daemon answers 409 or 500 "is not running"). The container's
        files survive a restart, so the trajectory can go on.
        """
        import docker  # noqa: PLC0415

        try:
            return call()
        except docker.errors.APIError as exc:
            if not _stopped(exc):
                raise SandboxError(f"{what} failed in {self._container.short_id}: {exc}") from exc
        self._restart_stopped()
        try:
            return call()
        except docker.errors.APIError as exc:
            raise SandboxError(f"{what} failed in {self._container.short_id}: {exc}") from exc

    def _restart_stopped(self) -> None:
        # `wait` returns once the container is not running (at once if it has exited).
        self._container.wait(timeout=60)
        self._container.start()

    def _result(
        self,
        out: BoundedOutput,
        err: BoundedOutput,
        exit_code: int | None,
        timed_out: bool,
        duration: float,
    ) -> ExecResult:
        stderr = err.render()
        reason = classify_exit(exit_code, timed_out=timed_out, stderr_tail=stderr[-2000:])
        if exit_code == _SIGKILL_STATUS and self._oom_killed_since_last_check():
            reason = "memory"
        return ExecResult(
            exit_code=exit_code,
            stdout=out.render(),
            stderr=stderr,
            timed_out=timed_out,
            killed_reason=reason,
            duration_s=duration,
            output_truncated=out.truncated or err.truncated,
            stdout_bytes=out.total_bytes,
            stderr_bytes=err.total_bytes,
        )

    def _exec_run(self, argv: list[str]) -> tuple[int, bytes]:
        """A short helper command of the backend's own (not the agent's), output in one piece."""
        code, output = self._while_running(lambda: self._container.exec_run(argv), repr(argv[:3]))
        return code, output or b""

    def _kill_tree(self, pid_file: str) -> None:
        self._exec_run(["/bin/sh", "-c", _KILL_TREE, "sh", pid_file])

    def _read_oom_kills(self) -> int | None:
        # cgroup v2 first, then v1; both report a cumulative oom_kill counter.
        files = "/sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control"
        _code, output = self._exec_run(["/bin/sh", "-c", f"cat {files} 2>/dev/null"])
        match = _OOM_KILL.search(output)
        return int(match.group(1)) if match else None

    def _oom_killed_since_last_check(self) -> bool:
        count = self._read_oom_kills()
        killed = count is not None and self._oom_kills is not None and count > self._oom_kills
        self._oom_kills = count
        return killed

    def _run_checked(self, argv: list[str]) -> None:
        result = self.exec(argv, timeout_s=_SETUP_TIMEOUT_S)
        if result.exit_code != 0:
            raise SandboxError(f"{' '.join(argv)!r} failed in the container: {result.stderr}")

    # -- files --------------------------------------------------------------------------

    def write_file(self, relpath: str, data: str | bytes) -> None:
        self._check_open()
        parts = relative_parts(relpath)
        if not parts:
            raise SandboxPathError(f"{relpath!r}: names the workdir itself, not a file")
        payload = data.encode() if isinstance(data, str) else data
        self._put_files(self.workdir, {"/".join(parts): payload})

    def read_file(self, relpath: str) -> bytes:
        self._check_open()
        return self._get_file(self.workdir, relpath)

    def copy_in(self, src: Path, dest_rel: str = ".") -> None:
        self._check_open()
        src = Path(src)
        if not src.exists():
            raise FileNotFoundError(f"copy_in: source {src} does not exist")
        dest = "/".join(relative_parts(dest_rel)) or "."
        if src.is_file() and (dest == "." or self._is_dir(f"{self.workdir}/{dest}")):
            dest = f"{dest}/{src.name}"
        self._put_tree(self.workdir, src, dest)

    def _is_dir(self, path: str) -> bool:
        code, _output = self._exec_run(["test", "-d", path])
        return code == 0

    def pull_workdir(self) -> Path:
        """Copy the container's workdir into ``host_workdir`` (replacing it) and return it."""
        self._check_open()
        shutil.rmtree(self.host_workdir, ignore_errors=True)
        chunks, _stat = self._client.api.get_archive(self._container.id, self.workdir)
        with tempfile.TemporaryFile() as spool:
            for chunk in chunks:
                spool.write(chunk)
            spool.seek(0)
            with tarfile.open(fileobj=spool) as archive:
                archive.extractall(self._staging, filter="data")
        return self.host_workdir

    def _put_files(self, folder: str, files: Mapping[str, bytes]) -> None:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            for name, payload in files.items():
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(payload), 0o644, int(time.time())
                archive.addfile(info, io.BytesIO(payload))
        self._put_archive(folder, buffer.getvalue(), f"{sorted(files)} into {folder}")

    def _put_archive(self, folder: str, data: Any, what: str) -> None:
        import docker  # noqa: PLC0415

        try:
            written = self._client.api.put_archive(self._container.id, folder, data)
        except docker.errors.APIError as exc:
            # A path through a symlink the agent made (to a missing folder, say).
            raise SandboxPathError(f"could not write {what} in the container: {exc}") from exc
        if not written:
            raise SandboxError(f"could not write {what} in the container")

    def _put_tree(self, folder: str, src: Path, arcname: str) -> None:
        with tempfile.TemporaryFile() as spool:
            with tarfile.open(fileobj=spool, mode="w") as archive:
                archive.add(src, arcname=arcname, filter=_owned_by_root)
            spool.seek(0)
            self._put_archive(folder, spool, f"{src} as {folder}/{arcname}")

    def _get_file(self, folder: str, relpath: str) -> bytes:
        import docker  # noqa: PLC0415

        path = "/".join((folder, *relative_parts(relpath)))
        try:
            chunks, _stat = self._client.api.get_archive(self._container.id, path)
        except docker.errors.NotFound as exc:
            raise FileNotFoundError(f"{path} does not exist in the sandbox") from exc
        with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as archive:
            member = archive.next()
            if member is None or not member.isfile():
                raise SandboxPathError(f"{path} is not a regular file in the sandbox")
            handle = archive.extractfile(member)
            return handle.read() if handle is not None else b""

    # -- logs and verifier files -------------------------------------------------------

    def read_log(self, relpath: str) -> bytes:
        self._check_open()
        return self._get_file(LOGS_DIR, relpath)

    def clear_logs(self, subdir: str) -> None:
        self._check_open()
        parts = relative_parts(subdir)
        if not parts:
            raise SandboxPathError(f"clear_logs: {subdir!r} names {LOGS_DIR} itself")
        target = "/".join((LOGS_DIR, *parts))
        self._run_checked(["sh", "-c", 'rm -rf -- "$1" && mkdir -p -- "$1"', "sh", target])

    def install_tests(self, src: Path) -> str:
        self._check_open()
        if not Path(src).is_dir():
            raise FileNotFoundError(f"install_tests: {src} is not a folder")
        self._run_checked(["sh", "-c", f"rm -rf {TESTS_DIR} && mkdir -p {TESTS_DIR}"])
        self._put_tree(TESTS_DIR, Path(src), ".")
        return TESTS_DIR

    def _stop_container(self) -> None:
        """Kill the container and wait until it has stopped (it may be stopping already:
        the agent can end its main process)."""
        import docker  # noqa: PLC0415

        self._container.reload()
        if self._container.status == "running":
            try:
                self._container.kill()
            except docker.errors.APIError:
                self._container.reload()
                if self._container.status == "running":
                    raise
        self._container.wait(timeout=60)

    def begin_verification(self, *, fresh: bool) -> None:
        self._check_open()
        if fresh:
            self._replace_container()
        else:
            # Killing the container's init ends every process in it; its files stay.
            self._stop_container()
            self._container.start()
        # Root here lacks CAP_DAC_OVERRIDE: folders the agent made read-only are opened up
        # first, so that it cannot keep its files (or stop the grading) that way.
        reset = (
            f"chmod -R u+rwX /tmp {LOGS_DIR} {TESTS_DIR} 2>/dev/null; "
            f"find /tmp -mindepth 1 -delete; rm -rf {LOGS_DIR} {TESTS_DIR}; "
            f"mkdir -p {LOGS_DIR}/verifier {TESTS_DIR} {_CONTROL_DIR}"
        )
        self._run_checked(["sh", "-c", reset])
        self._oom_kills = self._read_oom_kills()

    def _replace_container(self) -> None:
        """A new container from the image holding the old one's workdir; the old one goes."""
        chunks, _stat = self._client.api.get_archive(self._container.id, self.workdir)
        with tempfile.TemporaryFile() as spool:
            for chunk in chunks:
                spool.write(chunk)
            spool.seek(0)
            old = self._container
            self._finalizer.detach()
            _close_container(old, None)
            self._container = self._start()
            self._finalizer = weakref.finalize(
                self, _close_container, self._container, self._staging
            )
            parent = str(PurePosixPath(self.workdir).parent)
            make = 'rm -rf -- "$1" && mkdir -p -- "$2"'
            self._run_checked(["sh", "-c", make, "sh", self.workdir, parent])
            self._put_archive(parent, spool, f"{self.workdir} carried over")

    def close(self) -> None:
        self._finalizer()


def _consume(
    stream: Iterable[tuple[bytes | None, bytes | None]],
    out: BoundedOutput,
    err: BoundedOutput,
    failures: list[BaseException],
) -> None:
    """Feed the demultiplexed stream into the buffers; a failure is handed to the caller."""
    try:
        for stdout_chunk, stderr_chunk in stream:
            if stdout_chunk:
                out.feed(stdout_chunk)
            if stderr_chunk:
                err.feed(stderr_chunk)
    # Re-raised by the caller, unless it closed the stream itself after a kill.
    except Exception as exc:
        failures.append(exc)


def _owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Without CAP_DAC_OVERRIDE, root in the container cannot write files owned by the host
    # user's uid, so copies are handed to root.
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info
