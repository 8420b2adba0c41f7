"""Local sandbox: bubblewrap namespaces, rlimits and a private workdir per trajectory.

Each ``exec`` starts a fresh ``bwrap`` whose root is an empty read-only tmpfs holding only
read-only binds of the system folders (/usr, /etc, /opt and the merged-/usr links), the
running Python's prefixes (the interpreter and the project venv) and the caller's
``ro_binds``. Writable are only the trajectory's folders, bound from one host folder:
``work`` at the workdir (``/app``), ``tmp`` at ``/tmp`` and ``logs`` at ``/logs``; ``tests``
is bound read-only at ``/tests`` so that only the host (a grader) can fill it. The command
gets its own network namespace (no interfaces but a down loopback: the host's loopback is
unreachable), pid, IPC and UTS namespaces.

Scheduling: a command stays in its caller's session, so it shares the caller's scheduling
group and niceness. A new session per command would make each one its own group where the
kernel groups tasks by session (autogroup: most Linux distributions), weighed like the whole
training process, so a role's niceness would not hold against the commands it starts. The
session's controlling terminal, if it has one, stays out of reach: ``/dev/tty`` in the
sandbox is ``/dev/null``, no terminal descriptor is inherited, and the sandbox's pid
namespace hides every other process's descriptors (so TIOCSTI has no terminal to type
into).

Stopping everything a command started: bwrap's namespace init dies with bwrap
(``--die-with-parent``), and the kernel kills every process of a pid namespace when its
init dies. So killing bwrap's process group on timeout, or the command's own exit, leaves
nothing behind, including fork bombs and daemons started with ``&``.

Limits: ``prlimit`` sets RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE and RLIMIT_CORE=0. The kernel
never applies RLIMIT_NPROC to uid 0, so when the host runs as root each sandbox leases a
private unprivileged uid (from ``UID_RANGE``) and the command runs under it (``setpriv``):
RLIMIT_NPROC then caps that sandbox alone, and the command holds no capabilities. Without
root, bwrap runs in a user namespace as the calling user and RLIMIT_NPROC is not set (it
would count all of that user's processes); the pid namespace and the timeout still bound
a fork bomb.

Not covered: disk usage (only the per-file size limit), CPU share (needs cgroups; a
command that starts a session of its own, ``setsid``, is its own autogroup again).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, BinaryIO

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

__all__ = ["UID_RANGE", "LocalSandbox", "run_bounded"]

# Private uids for sandboxed commands when the host runs as root: far above login users
# and the usual /etc/subuid ranges (100000-165535 per user).
UID_RANGE = range(1_500_000_000, 1_500_000_000 + 65_536)
_SYSTEM_DIRS = ("/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_RESERVED_DIRS = frozenset({"dev", "proc", "sys", "tmp", "logs", "tests", "run"})
_CHUNK_BYTES = 1 << 20
# After a kill, how long the pipes may take to report EOF before they are abandoned.
_KILL_GRACE_S = 5.0
_SETUP_TIMEOUT_S = 30.0
_DEV_SHM_BYTES = 64 << 20
# The bubblewrap binaries that have started a sandbox in this process. Whether one can
# (user namespaces, capabilities, seccomp) is a property of the host, so it is probed once
# per process, not once per sandbox: a rollout opens one sandbox per episode.
_BWRAP_STARTED: set[str] = set()


def _require_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SandboxUnavailable(
            f"'{name}' not found on PATH: the local sandbox needs it "
            f"(Debian/Ubuntu package '{package}': apt-get install -y {package})"
        )
    return path


class _UidLease:
    """An unprivileged uid held by this sandbox alone, across processes, until released.

    A lease is an exclusive ``flock`` on ``<tmp>/thundersync-sandbox-uids/<uid>``; the kernel
    drops it if the holder dies, so a crashed run never leaks a uid.
    """

    def __init__(self) -> None:
        lock_dir = Path(tempfile.gettempdir()) / "thundersync-sandbox-uids"
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        for uid in random.sample(UID_RANGE, 64):
            handle = open(lock_dir / str(uid), "a+b")  # noqa: SIM115 (held for the lease)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self.uid = uid
            self._handle: IO[bytes] | None = handle
            return
        raise SandboxError(f"no free sandbox uid after 64 tries in {lock_dir}")

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _remove_tree(path: Path) -> None:
    """Delete ``path`` even where the sandboxed command removed write permission."""
    if os.path.lexists(path):
        shutil.rmtree(path, onerror=_retry_writable)


def _retry_writable(func: Callable[[str], object], failed: str, _exc_info: object) -> None:
    os.chmod(os.path.dirname(failed), stat.S_IRWXU)
    if os.path.isdir(failed) and not os.path.islink(failed):
        os.chmod(failed, stat.S_IRWXU)
        shutil.rmtree(failed, onerror=_retry_writable)
    else:
        func(failed)


ROOT_PREFIX = "thundersync-sandbox-"
OWNER_FILE = ".owner"
_swept: set[str] = set()


def _hold_root(root: Path) -> IO[bytes]:
    """Lock ``root``'s owner file for as long as the returned handle stays open.

    The lock is taken on a file under another name and only then renamed into place (the
    lock follows the file), so a sweeper never finds an owner file that is not yet locked.
    """
    fresh = root / f"{OWNER_FILE}-new"
    handle = open(fresh, "a+b")  # noqa: SIM115 (held for the sandbox's life)
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fresh.rename(root / OWNER_FILE)
    return handle


def sweep_orphans(tmp: Path) -> list[Path]:
    """Remove the sandbox roots under ``tmp`` whose owner died without closing them.

    A killed process (SIGKILL, a crashed Ray actor) runs no finalizer, so its sandboxes'
    folders stay; its lock on each root's owner file went with it. A root whose owner file
    can be locked here has no owner left and is removed; one still locked, or without an
    owner file (another version's, or not yet held), is left alone.
    """
    removed: list[Path] = []
    for root in tmp.glob(f"{ROOT_PREFIX}*"):
        owner = root / OWNER_FILE
        try:
            handle = open(owner, "rb")  # noqa: SIM115
        except OSError:  # no owner file, not a folder, or removed meanwhile
            continue
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner lives
            _remove_tree(root)
        removed.append(root)
    return removed


def _sweep_once() -> None:
    """Sweep the temp folder for orphaned roots, once per process and folder."""
    tmp = tempfile.gettempdir()
    if tmp not in _swept:
        _swept.add(tmp)
        sweep_orphans(Path(tmp))


def _cleanup(root: Path, lease: _UidLease | None, owner: IO[bytes] | None) -> None:
    _remove_tree(root)
    if owner is not None:
        owner.close()
    if lease is not None:
        lease.release()


class LocalSandbox(Sandbox):
    """A bubblewrap sandbox whose files live in one host folder, removed on close."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        workdir: str = "/app",
        ro_binds: Sequence[Path] = (),
        workdir_from: Path | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.workdir = _check_workdir(workdir)
        self._bwrap = _require_tool("bwrap", "bubblewrap")
        self._prlimit = _require_tool("prlimit", "util-linux")
        self._setpriv = _require_tool("setpriv", "util-linux") if os.geteuid() == 0 else None
        self._lease = _UidLease() if self._setpriv else None
        self.python = sys.executable
        _sweep_once()
        self._root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))
        try:
            owner = _hold_root(self._root)
        except BaseException:
            _cleanup(self._root, self._lease, None)
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._root, self._lease, owner)
        self.host_workdir = self._root / "work"
        self.host_logs_dir = self._root / "logs"
        self._host_tests_dir = self._root / "tests"
        try:
            self._make_host_dirs()
            self._mount_args = _mount_args(self._root, self.workdir, ro_binds)
            self._check_bwrap_starts()
            if workdir_from is not None:
                self.copy_in(workdir_from)
        except BaseException:
            self.close()
            raise

    @property
    def uid(self) -> int | None:
        """The host uid commands run as, or None when they run as the calling user."""
        return self._lease.uid if self._lease else None

    def _make_host_dirs(self, *, workdir: bool = True) -> None:
        for path in (self.host_workdir, self._root / "tmp", self.host_logs_dir):
            if workdir or path != self.host_workdir:
                path.mkdir(mode=0o755)
                self._own(path)
        self._host_tests_dir.mkdir(mode=0o755)

    def _check_bwrap_starts(self) -> None:
        if self._bwrap in _BWRAP_STARTED:
            return
        probe = self.exec(["true"], timeout_s=_SETUP_TIMEOUT_S)
        if probe.exit_code != 0:
            raise SandboxUnavailable(
                f"bubblewrap ({self._bwrap}) could not start a sandbox here "
                f"(exit {probe.exit_code}): {probe.stderr.strip()}"
            )
        _BWRAP_STARTED.add(self._bwrap)

    def _own(self, path: Path) -> None:
        if self._lease is not None:
            os.chown(path, self._lease.uid, self._lease.uid, follow_symlinks=False)

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise SandboxError(f"sandbox {self._root} is closed")

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
        argv = [self._bwrap, *self._mount_args, *self._env_args(env), "--", *self._limit_argv()]
        argv += ["bash", "-c", command] if isinstance(command, str) else list(command)
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        with _stdin_source(stdin) as source:
            return run_bounded(
                argv, stdin=source, timeout_s=timeout, output_bytes=self.limits.output_bytes
            )

    def _env_args(self, env: Mapping[str, str] | None) -> list[str]:
        merged = _default_env() | dict(env or {})
        args = ["--chdir", self.workdir, "--clearenv"]
        for key, value in merged.items():
            args += ["--setenv", key, value]
        return args

    def _limit_argv(self) -> list[str]:
        limits = self.limits
        prlimit = [
            self._prlimit,
            f"--as={limits.memory_mb << 20}",
            # SIGXCPU at the soft limit names the cause; SIGKILL a second later if ignored.
            f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
            f"--fsize={limits.max_file_mb << 20}",
            "--core=0",
        ]
        if self._lease is None or self._setpriv is None:
            return [*prlimit, "--"]
        uid = str(self._lease.uid)
        setpriv = [
            self._setpriv,
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]
        return [*setpriv, *prlimit, f"--nproc={limits.max_processes}", "--"]

    # -- files --------------------------------------------------------------------------

    def write_file(self, relpath: str, data: str | bytes) -> None:
        self._check_open()
        payload = data.encode() if isinstance(data, str) else data
        target = self._writable_target(self.host_workdir, relpath)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        self._own(target)

    def read_file(self, relpath: str) -> bytes:
        self._check_open()
        return _read_regular(self.host_workdir, relpath)

    def copy_in(self, src: Path, dest_rel: str = ".") -> None:
        self._check_open()
        src = Path(src)
        if not src.exists():
            raise FileNotFoundError(f"copy_in: source {src} does not exist")
        dest_parts = relative_parts(dest_rel)
        if src.is_file():
            into_folder = self.host_workdir.joinpath(*dest_parts).is_dir()
            leaf = (src.name,) if into_folder or not dest_parts else ()
            self._copy_file(src, "/".join((*dest_parts, *leaf)))
            return
        for folder, dirnames, filenames in os.walk(src):
            rel = Path(folder).relative_to(src).parts
            self._ensure_dir(self.host_workdir, (*dest_parts, *rel))
            for name in dirnames + filenames:
                entry = Path(folder) / name
                if entry.is_symlink() or entry.is_file():
                    self._copy_file(entry, "/".join((*dest_parts, *rel, name)))

    def _copy_file(self, src: Path, relpath: str) -> None:
        target = self._writable_target(self.host_workdir, relpath)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        else:
            mode = 0o644 | (src.stat().st_mode & 0o111)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out, open(src, "rb") as source:
                shutil.copyfileobj(source, out, _CHUNK_BYTES)
        self._own(target)

    def _writable_target(self, root: Path, relpath: str) -> Path:
        """Host path for ``relpath`` with real parent folders; an old entry is removed."""
        parts = relative_parts(relpath)
        if not parts:
            raise SandboxPathError(f"{relpath!r}: names the folder itself, not a file")
        self._ensure_dir(root, parts[:-1])
        target = root.joinpath(*parts)
        if target.is_symlink():
            target.unlink()
        elif target.is_dir():
            raise IsADirectoryError(f"{relpath!r} is a folder in the sandbox")
        return target

    def _ensure_dir(self, root: Path, parts: Sequence[str]) -> None:
        """Create ``root/parts`` as real folders; a symlink on the way is refused, not followed."""
        current = root
        for index, part in enumerate(parts):
            current = current / part
            try:
                mode = os.lstat(current).st_mode
            except FileNotFoundError:
                current.mkdir(mode=0o755)
                self._own(current)
                continue
            if not stat.S_ISDIR(mode):
                shown = "/".join(parts[: index + 1])
                raise SandboxPathError(f"{shown!r} in the sandbox is not a folder (or a symlink)")

    # -- logs and verifier files -------------------------------------------------------

    def read_log(self, relpath: str) -> bytes:
        self._check_open()
        return _read_regular(self.host_logs_dir, relpath)

    def clear_logs(self, subdir: str) -> None:
        self._check_open()
        parts = relative_parts(subdir)
        if not parts:
            raise SandboxPathError(f"clear_logs: {subdir!r} names {LOGS_DIR} itself")
        self._ensure_dir(self.host_logs_dir, parts[:-1])
        target = self.host_logs_dir.joinpath(*parts)
        if target.is_symlink() or target.is_file():
            target.unlink()
        _remove_tree(target)
        target.mkdir(mode=0o755)
        self._own(target)

    def install_tests(self, src: Path) -> str:
        self._check_open()
        if not Path(src).is_dir():
            raise FileNotFoundError(f"install_tests: {src} is not a folder")
        _remove_tree(self._host_tests_dir)
        shutil.copytree(src, self._host_tests_dir, symlinks=True)
        for folder, _dirnames, filenames in os.walk(self._host_tests_dir):
            self._own(Path(folder))
            for name in filenames:
                self._own(Path(folder) / name)
        return TESTS_DIR

    def begin_verification(self, *, fresh: bool) -> None:
        # No process outlives its exec here (its pid namespace dies with it), so what the
        # agent can have left behind are files, and outside the workdir it can write only
        # /tmp and /logs (a user site-packages under $HOME=/tmp, a planted report, a reward).
        self._check_open()
        for path in (self._root / "tmp", self.host_logs_dir, self._host_tests_dir):
            _remove_tree(path)
        self._make_host_dirs(workdir=False)
        self.clear_logs("verifier")

    def close(self) -> None:
        self._finalizer()


def _check_workdir(workdir: str) -> str:
    parts = Path(workdir).parts
    if not Path(workdir).is_absolute() or len(parts) < 2 or ".." in parts:
        raise SandboxPathError(f"workdir {workdir!r} must be an absolute path below /")
    if parts[1] in _RESERVED_DIRS or f"/{parts[1]}" in _SYSTEM_DIRS:
        raise SandboxPathError(f"workdir {workdir!r} collides with a sandbox system folder")
    return str(Path(workdir))


def _default_env() -> dict[str, str]:
    path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    if sys.prefix != sys.base_prefix:
        path = f"{sys.prefix}/bin:{path}"
    return {"PATH": path, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


def _python_dirs() -> list[Path]:
    """The running interpreter's installation and venv, so ``python3`` works inside."""
    found = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    found.add(Path(sys.executable).resolve().parent.parent)
    return sorted(p for p in found if not any(p.is_relative_to(s) for s in _SYSTEM_DIRS))


def _mount_args(root: Path, workdir: str, ro_binds: Sequence[Path]) -> list[str]:
    plan = _MountPlan()
    for name in _SYSTEM_DIRS:
        if os.path.islink(name):
            plan.args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            plan.ro_bind(Path(name))
    # /dev/tty would be the caller's controlling terminal: the command shares its session.
    plan.args += ["--dev", "/dev", "--dev-bind", "/dev/null", "/dev/tty"]
    plan.args += ["--perms", "1777", "--size", str(_DEV_SHM_BYTES)]
    plan.args += ["--tmpfs", "/dev/shm", "--proc", "/proc"]
    plan.bind(root / "tmp", Path("/tmp"))
    plan.bind(root / "logs", Path(LOGS_DIR))
    plan.ro_bind(root / "tests", Path(TESTS_DIR))
    plan.bind(root / "work", Path(workdir))
    # Last, so that an interpreter, venv or caller's path below /tmp (a checkout in /tmp,
    # say) is not hidden by the private /tmp.
    for path in _python_dirs():
        plan.ro_bind(path)
    for path in ro_binds:
        if not Path(path).is_absolute() or not Path(path).exists():
            raise SandboxPathError(f"ro_binds: {path} must be an existing absolute path")
        plan.ro_bind(Path(path))
    args = [*plan.args, "--remount-ro", "/", "--hostname", "sandbox"]
    args += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    args += ["--unshare-cgroup-try", "--die-with-parent"]
    if os.geteuid() != 0:
        args.append("--unshare-user")
    return args


class _MountPlan:
    """bwrap mount arguments, creating each missing parent folder once, mode 0755.

    bwrap would create missing parents itself, but copying the host's modes (``/root`` is
    0700), which would hide a bound interpreter from the unprivileged sandbox uid.
    """

    def __init__(self) -> None:
        self.args: list[str] = ["--tmpfs", "/"]
        self._read_only: list[Path] = []
        self._existing: set[Path] = {Path("/"), Path("/dev"), Path("/proc")}

    def ro_bind(self, src: Path, dest: Path | None = None) -> None:
        dest = dest or src
        self.args += [*self._parents(dest), "--ro-bind", str(src), str(dest)]
        self._read_only.append(dest)
        self._existing.add(dest)

    def bind(self, src: Path, dest: Path) -> None:
        self.args += [*self._parents(dest), "--bind", str(src), str(dest)]
        self._existing.add(dest)

    def _parents(self, path: Path) -> list[str]:
        args: list[str] = []
        for parent in reversed(path.parents):
            inside_read_only = any(parent.is_relative_to(p) for p in self._read_only)
            if parent not in self._existing and not inside_read_only:
                args += ["--perms", "0755", "--dir", str(parent)]
                self._existing.add(parent)
        return args


def _read_regular(root: Path, relpath: str) -> bytes:
    """A regular file below ``root``; no component of the path may be a symlink."""
    parts = relative_parts(relpath)
    current = root
    for part in parts[:-1]:
        current = current / part
        if current.is_symlink():
            raise SandboxPathError(f"{relpath!r}: {part!r} is a symlink; it is not followed")
    path = root.joinpath(*parts)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if path.is_symlink():
            raise SandboxPathError(f"{relpath!r} is a symlink; it is not followed") from exc
        raise
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise SandboxPathError(f"{relpath!r} is not a regular file")
        return handle.read()


@contextlib.contextmanager
def _stdin_source(stdin: str | None) -> Iterator[int | BinaryIO]:
    """The command's stdin: /dev/null, or a spooled file so no pipe can deadlock."""
    if stdin is None:
        yield subprocess.DEVNULL
        return
    with tempfile.TemporaryFile() as handle:
        handle.write(stdin.encode())
        handle.seek(0)
        yield handle


def run_bounded(
    argv: Sequence[str],
    *,
    stdin: int | BinaryIO,
    timeout_s: float,
    output_bytes: int,
) -> ExecResult:
    """Run ``argv`` in a new process group of the caller's session (see the module's
    Scheduling); kill the group at ``timeout_s``; bound output."""
    start = time.monotonic()
    sinks = {"stdout": BoundedOutput(output_bytes), "stderr": BoundedOutput(output_bytes)}
    with subprocess.Popen(
        argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0
    ) as proc:
        try:
            finished = _pump(proc, sinks, start + timeout_s) and _wait(proc, start + timeout_s)
            if not finished:
                _kill_group(proc)
                _pump(proc, sinks, time.monotonic() + _KILL_GRACE_S)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            proc.wait()
    status = proc.returncode
    exit_code = None if not finished else (128 - status if status < 0 else status)
    stderr = sinks["stderr"].render()
    return ExecResult(
        exit_code=exit_code,
        stdout=sinks["stdout"].render(),
        stderr=stderr,
        timed_out=not finished,
        killed_reason=classify_exit(exit_code, timed_out=not finished, stderr_tail=stderr[-2000:]),
        duration_s=time.monotonic() - start,
        output_truncated=sinks["stdout"].truncated or sinks["stderr"].truncated,
        stdout_bytes=sinks["stdout"].total_bytes,
        stderr_bytes=sinks["stderr"].total_bytes,
    )


def _pump(proc: subprocess.Popen, sinks: dict[str, BoundedOutput], deadline: float) -> bool:
    """Read both pipes into their sinks until EOF (True) or ``deadline`` (False)."""
    with selectors.DefaultSelector() as selector:
        for name, sink in sinks.items():
            pipe = getattr(proc, name)
            if pipe is not None and not pipe.closed:
                selector.register(pipe, selectors.EVENT_READ, (sink, pipe))
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _events in selector.select(timeout=remaining):
                sink, pipe = key.data
                chunk = os.read(key.fd, _CHUNK_BYTES)
                if chunk:
                    sink.feed(chunk)
                else:
                    selector.unregister(pipe)
                    pipe.close()
    return True


def _wait(proc: subprocess.Popen, deadline: float) -> bool:
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return False
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    # bwrap leads its own process group (process_group=0), so its pid is the group id; its
    # namespace init follows it (--die-with-parent), and with it every sandboxed process.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
