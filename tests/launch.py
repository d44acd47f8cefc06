"""Start ``python ...`` processes for the tests, cheaply: :func:`run` and :func:`popen` take
what :func:`subprocess.run` and :class:`subprocess.Popen` take, and start a ``python
train.py ...``, ``python -m repro ...``, ``python -m torch.distributed.run ...``, ``python
scripts/x.py ...`` or ``python -c ...`` by forking an interpreter that has imported torch,
Hydra and this package once (multiprocessing's forkserver), instead of starting one that
imports them again: on the 2-core CI machine that is about 4 s of CPU less per process, a
few minutes per suite. What a forked process starts in turn -- a script's runs, a
torchrun's ranks -- is forked from it the same way (it has imported the same): a forked
torchrun is torchrun (rendezvous, the ranks' environment, monitoring, restarts, signals).
A process forked from one that had started CUDA (torchrun's agent on a GPU machine has, by
the time it starts its ranks) could not start it again, so it makes itself a real
interpreter (the same pid, files and session).

A forked process is a process: its own pid, exit status, files, signal dispositions (a new
interpreter's), process group (``start_new_session``) and loader workers (forked from it,
as from ``python train.py``); it runs the script as ``__main__`` with ``sys.argv`` (and
``sys.orig_argv``, what a re-execution runs) as given, and ends through multiprocessing's
exit handler (which joins its child processes). What it does not do is start an
interpreter or end one (``atexit``, non-daemon threads), nor show its environment in
``/proc/PID/environ`` (that is its parent's), so a command for which that is the point
starts a real one: an environment without the pinned ``PYTHONHASHSEED``, a
``sitecustomize`` on ``PYTHONPATH`` other than ``tests/faults`` (whose faults the fork
installs itself), and ``real=True`` (the tests of what happens at a process's exit).
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.util
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "tests" / "faults"
# imported once, in the server the processes are forked from
PRELOAD = [
    "torch",
    "torch._dynamo",
    "hydra",
    "omegaconf",
    "repro.engine.loop",
    "repro.cli",
    "repro.tools.compare",
]
# set (to anything): every process starts a real interpreter, as without this module (to
# tell a fault of the tests' own launching from one of the code under test)
NO_FORK = "REPRO_TESTS_NO_FORK"
# must be what the server started with: they are read when an interpreter starts
AT_START = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "PYTHONUNBUFFERED")

_context: Any = None
# the files that carry a forked process's output back: a folder of this process's, made on
# first use and removed as this process ends (multiprocessing's exit handler: an interpreter's
# or a forked process's end alike), so that no run of the suite leaves one behind
_outputs: tuple[int, Path] | None = None
# the sys.path of a new interpreter before its script's folder and PYTHONPATH (the standard
# library, site-packages, the editable install): not the test session's additions
_BASE_PATH: list[str] = []


# the signal dispositions a new interpreter starts with (a forked process takes its parent's)
_STARTING_HANDLERS = {
    sig: signal.SIG_DFL
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGCHLD, signal.SIGALRM)
} | {signal.SIGINT: signal.default_int_handler}  # fmt: skip


def _server() -> Any:
    global _context
    if _context is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        probe = [sys.executable, "-c", "import sys; print(repr(sys.path[1:]))"]
        _BASE_PATH[:] = eval(subprocess.run(probe, env=env, capture_output=True, text=True).stdout)
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def start_method() -> str:
    """For ``torch.multiprocessing.start_processes(..., start_method=start_method())``: its
    processes forked from the server (which imported torch once), or real interpreters
    ("spawn") under :data:`NO_FORK`."""
    if os.environ.get(NO_FORK):
        return "spawn"
    _server()  # the one forkserver of this process, with PRELOAD
    return "forkserver"


def _forkable(cmd: list[str], env: dict[str, str], real: bool) -> bool:
    if real or len(cmd) < 2 or cmd[0] != sys.executable or os.environ.get(NO_FORK):
        return False
    if cmd[1] == "-u":  # unbuffered output: what the forked process is given (_child)
        cmd = [cmd[0], *cmd[2:]]
    if len(cmd) < 2 or (cmd[1] == "-m" and len(cmd) < 3):
        return False
    if cmd[1] not in ("-m", "-c") and not cmd[1].endswith(".py"):
        return False
    if any(env.get(k) != os.environ.get(k) for k in AT_START if k != "PYTHONUNBUFFERED"):
        return False  # strict mode would re-execute: that must be a real interpreter
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return all(not (Path(p) / "sitecustomize.py").is_file() or Path(p) == FAULTS for p in paths)


def _child(
    cmd: list[str],
    env: dict[str, str],
    cwd: str,
    fds: tuple[str | int | None, str | int | None, str | int | None],
    session: bool,
    base_path: list[str],
) -> None:
    """In the forked process: become ``python cmd[1:]`` in ``cwd`` with ``env``; ``fds``:
    stdin, stdout and stderr, each a file to open, a descriptor to take, or None to keep."""
    if session:
        os.setsid()
    for sig, handler in _STARTING_HANDLERS.items():  # an interpreter's, not its parent's
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR as given, not the one its parent read
    for target, source in enumerate(fds):
        if isinstance(source, int):
            os.dup2(source, target)
        elif source is not None:
            fd = os.open(source, os.O_RDONLY if target == 0 else os.O_WRONLY | os.O_APPEND)
            os.dup2(fd, target)
            os.close(fd)
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
        # forked from a process that had started CUDA (a torchrun agent on a GPU machine):
        # CUDA cannot start here, so become a real interpreter
        os.execve(sys.executable, list(cmd), env)
    if cmd[1] == "-u":  # python -u: unbuffered stdout and stderr
        cmd = [cmd[0], *cmd[2:]]
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            raw = open(stream.fileno(), "wb", buffering=0, closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, stream.encoding, stream.errors,
                                                write_through=True))  # fmt: skip
    multiprocessing.set_start_method(None, force=True)  # as unset as in a new interpreter
    subprocess.Popen = _Popen  # type: ignore[misc]  # what it starts is forked in turn
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        _fork_ranks_from_agent()
    sys.orig_argv = [sys.executable, *cmd[1:]]  # what strict mode re-executes, if it does
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = str(Path(cmd[1]).resolve().parent) if cmd[1].endswith(".py") else ""
    _BASE_PATH[:] = base_path  # for the processes it forks in turn (a torchrun agent's ranks)
    sys.path[:] = [first, *paths, *base_path]
    if str(FAULTS) in paths:  # what its sitecustomize does at an interpreter's start
        runpy.run_path(str(FAULTS / "sitecustomize.py"))
    code = 0
    try:
        if cmd[1] == "-m":
            sys.argv = [cmd[2], *cmd[3:]]
            runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        elif cmd[1] == "-c":
            sys.argv = ["-c", *cmd[3:]]
            exec(compile(cmd[2], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = cmd[1:]
            runpy.run_path(cmd[1], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # multiprocessing's exit handler runs as the process ends (it joins child processes:
    # the loader's workers), then it exits with this status; a real interpreter also joins
    # non-daemon threads and runs atexit: the tests of exit-time behaviour start one (real=)
    raise SystemExit(code)


def _fork_ranks_from_agent() -> None:
    """In a forked torchrun agent: its ranks (``python -u script ...``) are forked from it,
    which has imported torch, Hydra and this package, instead of starting interpreters (as
    torch's agent forks its workers itself when they are a function: start_method="fork").
    Everything else is torchrun's: rendezvous, environment, monitoring, restarts, signals."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler,
        )
    except ImportError:  # another torch: its ranks start interpreters
        return
    handler = subprocess_handler.SubprocessHandler
    started = handler._popen

    def _popen(self: Any, args: tuple, env: dict[str, str]) -> Any:
        cmd = [str(a) for a in args]
        if not _forkable(cmd, env, False):
            return started(self, args, env)
        return Forked(cmd, env, None, self._stdout, self._stderr, False, True, here=True)

    handler._popen = _popen


class _Popen(subprocess.Popen):
    """:class:`subprocess.Popen` in a forked process: a ``python ...`` it starts (a script's
    runs, ``repro``'s) is forked from it in turn when :func:`_forkable` and given only what
    :class:`Forked` does (no stdin, no descriptors to pass) and this process has one thread
    (forking a process with others, whose locks may be held, is what deadlocks), else
    started as ever."""

    _FORKED_KEYS = {"env", "cwd", "stdout", "stderr", "text", "universal_newlines",
                    "encoding", "errors", "start_new_session"}  # fmt: skip

    def __new__(cls, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        plain = not rest and isinstance(args, list | tuple) and kwargs.keys() <= cls._FORKED_KEYS
        if plain and len(os.listdir("/proc/self/task")) == 1:  # its threads, C++'s included
            cmd = [str(a) for a in args]
            env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
            if _forkable(cmd, env, False):
                text = bool(kwargs.get("text") or kwargs.get("universal_newlines"))
                text = text or kwargs.get("encoding") is not None
                return Forked(cmd, env, kwargs.get("cwd"), kwargs.get("stdout"),
                              kwargs.get("stderr"), text, bool(kwargs.get("start_new_session")),
                              here=True)  # fmt: skip
        return super().__new__(cls)


class Forked:
    """The :class:`subprocess.Popen` of a forked ``python`` process (no live pipes: what it
    writes is read by :meth:`communicate` once it has ended)."""

    def __init__(
        self, cmd, env, cwd, stdout, stderr, text, start_new_session, here: bool = False
    ) -> None:
        """``here``: forked from this process (multiprocessing's fork: a torchrun agent that
        was itself forked has imported what its ranks need), its descriptors inherited;
        else from the server."""
        self.args, self.text, self.returncode = cmd, text, None
        self.stdout = self.stderr = None
        self._read: list[Path | None] = [None, None]
        if stdout is None and stderr is None and not here:
            out = err = self._file("log")  # the server's output is not this caller's: a file
        else:
            out = self._target(stdout, 0, here)
            err = out if stderr is subprocess.STDOUT else self._target(stderr, 1, here)
        context = multiprocessing.get_context("fork") if here else _server()
        self.process = context.Process(
            target=_child,
            args=(
                list(cmd),
                env,
                str(cwd or os.getcwd()),
                (None if here else os.devnull, out, err),
                start_new_session,
                _BASE_PATH,
            ),
        )
        self.process.start()
        self.pid = self.process.pid
        while start_new_session and self.poll() is None:  # as Popen: the session exists
            try:  # when this returns, so that os.killpg(pid) reaches it
                if os.getpgid(self.pid) == self.pid:
                    break
            except ProcessLookupError:
                pass
            time.sleep(0.001)

    def _target(self, stream: Any, index: int, here: bool) -> str | int | None:
        """Where the child's stdout (``index`` 0) or stderr (1) goes: a file to open, a
        descriptor (forked here: inherited), or None: this process's."""
        if stream is subprocess.PIPE:
            path = self._file(("out", "err")[index])
            self._read[index] = Path(path)
            return path
        if stream is None:
            return None if here else self._file("log")
        if stream is subprocess.DEVNULL:
            return os.devnull
        fd = stream if isinstance(stream, int) else stream.fileno()
        if here:
            return fd
        named = os.readlink(f"/proc/self/fd/{fd}")  # the caller may close it once started
        # else a deleted file, a pipe: opened through this process, which holds it open
        return named if os.path.isfile(named) else f"/proc/{os.getpid()}/fd/{fd}"

    @staticmethod
    def _file(kind: str) -> str:
        global _outputs
        if _outputs is None or _outputs[0] != os.getpid():  # not a folder of its parent's
            _outputs = (os.getpid(), Path(tempfile.mkdtemp(prefix="repro-launch-")))
            multiprocessing.util.Finalize(None, shutil.rmtree, (_outputs[1], True), exitpriority=0)
        fd, path = tempfile.mkstemp(prefix=f"{kind}-", dir=_outputs[1])
        os.close(fd)
        return path

    def poll(self) -> int | None:
        if self.process.exitcode is not None:
            self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if input is not None:
            raise ValueError("a forked process has no stdin to write to")
        self.wait(timeout)
        outs = []
        for path in self._read:
            if path is None:
                outs.append(None)
                continue
            data = path.read_bytes()
            path.unlink()
            outs.append(data.decode(errors="replace") if self.text else data)
        return outs[0], outs[1]


def popen(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    start_new_session: bool = False,
    real: bool = False,
) -> Forked | subprocess.Popen:
    """:class:`subprocess.Popen` of ``cmd``, forked when it can be (module docstring);
    ``real``: a real interpreter in any case (what happens at its exit is the point)."""
    cmd = [str(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    if not _forkable(cmd, env, real):
        return subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=stdout,
            stderr=stderr,
            text=text,
            start_new_session=start_new_session,
        )
    return Forked(cmd, env, cwd, stdout, stderr, text, start_new_session)


def run(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Any = None,
    capture_output: bool = False,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    timeout: float | None = None,
    check: bool = False,
    start_new_session: bool = False,
    real: bool = False,
) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` of ``cmd``, forked when it can be (module docstring)."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=stdout,
        stderr=stderr,
        text=text,
        start_new_session=start_new_session,
        real=real,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
