"""A process sandbox for terminal agents: a fresh directory, a persistent bash session, limits.

**This is a process sandbox, not a container.** It gives each episode its own directory (removed at the
end), its own bash session, per-command and per-episode time limits, output truncation, rlimits (memory,
CPU seconds, file size, processes) and no network (a new network namespace: only a loopback device).
It does not hide the host's file system: a command can read what the sandbox's user may read. Run
untrusted tasks in a container or VM; a container runtime plugs in by replacing ``Sandbox`` (the same
``start`` / ``run`` / ``run_test`` / ``close``), e.g. ``docker run --network none`` with a
``docker exec`` per command.

As root each sandbox runs as its own unprivileged uid (from ``UID_POOL``), which makes the process limit
per episode and lets ``close`` kill every process the episode started, even ones that left its session.
As another user the process limit counts that user's existing tasks too, and ``close`` kills the
session's process group.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import fcntl
import functools
import os
import resource
import shutil
import signal
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxLimits", "CommandResult", "Sandbox", "network_isolation_problem"]

UID_POOL = range(61000, 62000)
UID_LOCKS = Path(tempfile.gettempdir()) / "titan-sandbox-uids"
"""One lock file per uid: sandboxes of every process on the host (two trainers, a test run beside a
trainer) take distinct uids, and a lock dies with the process that held it."""
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000


class _ShellExited(Exception):
    pass


@dataclass(frozen=True)
class SandboxLimits:
    command_timeout_s: float = 10.0
    episode_timeout_s: float = 300.0
    test_timeout_s: float = 60.0
    max_output_bytes: int = 4096  # of one command's output shown to the model (head and tail kept)
    memory_bytes: int = 1 << 30  # address space per process
    cpu_seconds: int = 60  # per process
    max_file_bytes: int = 64 << 20
    max_processes: int = 64
    network: bool = False


@dataclass(frozen=True)
class CommandResult:
    output: str
    exit_code: int | None  # None: timed out or the shell exited (a new one was started)
    truncated: bool = False


def _unshare_flags() -> int:
    return CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET


def _unshare(flags: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.unshare(flags) == 0 else ctypes.get_errno()


@functools.cache
def network_isolation_problem() -> str | None:
    """Why a sandbox here cannot be cut off from the network (None: it can), found once in a child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        os.write(w, str(_unshare(_unshare_flags())).encode())
        os._exit(0)
    os.close(w)
    err = int(os.read(r, 16) or b"-1")
    os.close(r)
    os.waitpid(pid, 0)
    if err == 0:
        return None
    return (f"no network namespace for the sandbox (unshare: {os.strerror(err) if err > 0 else 'failed'}): run as "
            f"root or with user namespaces enabled, or pass SandboxLimits(network=True) to run with the network")


def _take_uid() -> tuple[int, int]:
    """A uid from ``UID_POOL`` that no sandbox on this host holds, and the descriptor of its lock."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    for uid in UID_POOL:
        fd = os.open(UID_LOCKS / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise RuntimeError(f"all {len(UID_POOL)} sandbox uids are in use on this host")


def _kill_uid(uid: int) -> None:  # pragma: no cover - runs in a forked child
    """Kill every process of ``uid``, again until none is left: a fork bomb forks between two sweeps."""
    os.setgid(uid)
    os.setuid(uid)
    for _ in range(1000):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return


def _user_tasks(uid: int) -> int:
    n = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            n += int(fields.get("Threads", "1"))
    return n


class Sandbox:
    """One episode's sandbox. ``await start()``, ``await run(cmd)`` as often as needed, ``await run_test(path)``,
    ``await close()`` (always: it kills what is left and removes the directory)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), setup_dir: Path | None = None) -> None:
        if not limits.network and (problem := network_isolation_problem()):
            raise RuntimeError(problem)
        self.limits = limits
        self.setup_dir = setup_dir
        self.root = Path(tempfile.mkdtemp(prefix="titan-sandbox-"))
        self.work = self.root / "work"
        self.uid: int | None = None
        self._uid_lock = -1
        self.proc: asyncio.subprocess.Process | None = None
        self.closed = False

    # -- life cycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.setup_dir is not None:
            shutil.copytree(self.setup_dir, self.work)
        else:
            self.work.mkdir()
        if os.geteuid() == 0:
            self.uid, self._uid_lock = _take_uid()
            os.chmod(self.root, 0o755)
            for p in [self.work, *self.work.rglob("*")]:
                os.chown(p, self.uid, self.uid, follow_symlinks=False)
        await self._start_shell()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self._kill_all()
        shutil.rmtree(self.root, ignore_errors=True)
        if self.uid is not None:
            os.close(self._uid_lock)  # releases the uid for the next sandbox on this host
            self.uid = None

    # -- commands --------------------------------------------------------------------------------------
    async def run(self, command: str) -> CommandResult:
        """``command`` in the session (its ``cd`` and variables persist), stdin from /dev/null."""
        if self.proc is None or self.proc.returncode is not None:
            await self._start_shell()
        assert self.proc is not None and self.proc.stdin is not None
        marker = uuid.uuid4().hex
        encoded = base64.b64encode(command.encode()).decode()
        script = (f'eval "$(printf %s {encoded} | base64 -d)" < /dev/null\n'
                  f"printf '\\n{marker} %d\\n' \"$?\"\n")
        self.proc.stdin.write(script.encode())
        await self.proc.stdin.drain()
        proc = self.proc
        reader = asyncio.ensure_future(self._read_until(marker))
        exited = asyncio.ensure_future(self._exited(proc))  # `exit` with a background job holding the pipe: no EOF
        try:
            await asyncio.wait([reader, exited], timeout=self.limits.command_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not reader.done():
                reader.cancel()
                raise _ShellExited if exited.done() else asyncio.TimeoutError
            out, dropped, code = reader.result()
        except (asyncio.TimeoutError, _ShellExited) as e:
            what = "the shell exited" if isinstance(e, _ShellExited) else \
                f"timed out after {self.limits.command_timeout_s:g} s"
            await self._kill_all()
            await self._start_shell()
            return CommandResult(f"[{what}; a new shell was started: variables and the working directory are "
                                 f"reset, files are kept]", None)
        finally:
            exited.cancel()
        text, truncated = self._clip(out, dropped)
        return CommandResult(text, code, truncated)

    async def run_test(self, test_script: Path) -> tuple[int | None, str]:
        """The task's test script, outside the session, with the same limits; (exit status or None on a
        time-out, its clipped output). The script is copied in only now: the agent never saw it."""
        test_dir = Path(tempfile.mkdtemp(prefix="titan-test-", dir=self.root))
        script = test_dir / "test.sh"
        shutil.copy(test_script, script)
        os.chmod(test_dir, 0o755)
        os.chmod(script, 0o755)
        proc = await self._spawn(["bash", str(script)], stdin=asyncio.subprocess.DEVNULL)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.limits.test_timeout_s)
        except asyncio.TimeoutError:
            await self._kill_all()
            return None, f"[test timed out after {self.limits.test_timeout_s:g} s]"
        return proc.returncode, self._clip(out)[0]

    # -- internals -------------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.work), "TERM": "dumb", "LANG": "C.UTF-8",
                "PS1": "", "HISTFILE": "/dev/null"}

    def _preexec(self) -> None:  # pragma: no cover - runs in the child between fork and exec
        if not self.limits.network and _unshare(_unshare_flags()) != 0:
            os._exit(126)
        lim = self.limits
        nproc = lim.max_processes if self.uid is not None else _user_tasks(os.getuid()) + lim.max_processes
        for res, value in ((resource.RLIMIT_AS, lim.memory_bytes), (resource.RLIMIT_CPU, lim.cpu_seconds),
                           (resource.RLIMIT_FSIZE, lim.max_file_bytes), (resource.RLIMIT_NPROC, nproc),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        if self.uid is not None:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)

    async def _spawn(self, argv: list[str], stdin: int) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *argv, cwd=self.work, env=self._env(), stdin=stdin, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=self._preexec)

    async def _start_shell(self) -> None:
        self.proc = await self._spawn(["bash", "--noprofile", "--norc"], stdin=asyncio.subprocess.PIPE)

    @staticmethod
    async def _exited(proc: asyncio.subprocess.Process) -> None:
        # not proc.wait(): asyncio resolves it only once the pipes are closed too
        while proc.returncode is None:
            await asyncio.sleep(0.05)

    async def _read_until(self, marker: str) -> tuple[bytes, int, int]:
        """The command's output up to the marker line as (output kept, bytes dropped, exit code): the first
        and last ``max_output_bytes`` are kept, the middle of a flood is read and dropped, so the command
        never blocks on a full pipe and memory stays bounded."""
        assert self.proc is not None and self.proc.stdout is not None
        cap, key = self.limits.max_output_bytes, f"\n{marker} ".encode()
        keep = len(key) + 32  # the marker line may straddle two reads
        head, tail, dropped = bytearray(), bytearray(), 0
        while True:
            chunk = await self.proc.stdout.read(1 << 16)
            if not chunk:
                raise _ShellExited  # e.g. `exit`: a new shell, like after a time-out
            tail += chunk
            at = tail.find(key)
            if at >= 0:
                while (end := tail.find(b"\n", at + len(key))) < 0:
                    more = await self.proc.stdout.read(64)
                    if not more:
                        raise _ShellExited
                    tail += more
                return bytes(head + tail[:at]), dropped, int(tail[at + len(key):end])
            movable = len(tail) - keep
            if movable > 0 and len(head) < cap:
                n = min(cap - len(head), movable)
                head += tail[:n]
                del tail[:n]
                movable -= n
            if movable > cap:
                dropped += movable - cap
                del tail[:movable - cap]

    def _clip(self, out: bytes, dropped: int = 0) -> tuple[str, bool]:
        """At most ``max_output_bytes``: the head and the tail, and how much was cut between them."""
        cap, total = self.limits.max_output_bytes, len(out) + dropped
        if total <= cap:
            return out.decode(errors="replace"), False
        half = cap // 2
        cut = f"\n[... {total - 2 * half} bytes cut ...]\n".encode()
        return (out[:half] + cut + out[-half:]).decode(errors="replace"), True

    async def _kill_all(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.uid is not None:  # everything this uid runs, also what left the session
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                try:
                    _kill_uid(self.uid)
                finally:
                    os._exit(0)
            await asyncio.to_thread(os.waitpid, pid, 0)
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except asyncio.TimeoutError:
                pass
