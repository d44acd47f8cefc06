"""Start ``python ...`` processes for the tests, cheaply: :func:`run` and :func:`popen` take
what :func:`subprocess.run` and :class:`subprocess.Popen` take, and start a ``python
train.py ...``, ``python -m repro ...``, ``python scripts/x.py ...`` or ``python -c ...`` by
forking an interpreter that has imported torch, Hydra and this package once
(multiprocessing's forkserver), instead of starting one that imports them again: on the
2-core CI machine that is about 4 s less per process, a few minutes per suite.

A forked process is a process: its own pid, exit status, files, signal handlers, process
group (``start_new_session``) and loader workers (forked from it, as from ``python
train.py``); it runs the script as ``__main__`` with ``sys.argv`` (and ``sys.orig_argv``,
what a re-execution runs) as given, and ends through multiprocessing's exit handler (which
joins its child processes). What it does not do is start an interpreter or end one
(``atexit``, non-daemon threads), so a command for which that is the point starts a real
one: an environment without the pinned ``PYTHONHASHSEED``, a ``sitecustomize`` on
``PYTHONPATH`` other than ``tests/faults`` (whose faults the fork installs itself),
torchrun, and ``real=True`` (the tests of what happens at a process's exit).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
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
# must be what the server started with: they are read when an interpreter starts
AT_START = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "PYTHONUNBUFFERED")

_context: Any = None
_outputs = Path(tempfile.mkdtemp(prefix="repro-launch-"))
# the sys.path of a new interpreter before its script's folder and PYTHONPATH (the standard
# library, site-packages, the editable install): not the test session's additions
_BASE_PATH: list[str] = []


def _server() -> Any:
    global _context
    if _context is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        probe = [sys.executable, "-c", "import sys; print(repr(sys.path[1:]))"]
        _BASE_PATH[:] = eval(subprocess.run(probe, env=env, capture_output=True, text=True).stdout)
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _forkable(cmd: list[str], env: dict[str, str], real: bool) -> bool:
    if real or len(cmd) < 2 or cmd[0] != sys.executable:
        return False
    if cmd[1] == "-m" and (len(cmd) < 3 or cmd[2] == "torch.distributed.run"):
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
    fds: tuple[str, str, str],
    session: bool,
    base_path: list[str],
) -> None:
    """In the forked process: become ``python cmd[1:]`` in ``cwd`` with ``env``."""
    if session:
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for target, path in enumerate(fds):
        fd = os.open(path, os.O_RDONLY if target == 0 else os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, target)
        os.close(fd)
    multiprocessing.set_start_method(None, force=True)  # as unset as in a new interpreter
    sys.orig_argv = [sys.executable, *cmd[1:]]  # what strict mode re-executes, if it does
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = str(Path(cmd[1]).resolve().parent) if cmd[1].endswith(".py") else ""
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


class Forked:
    """The :class:`subprocess.Popen` of a forked ``python`` process (no live pipes: what it
    writes is read by :meth:`communicate` once it has ended)."""

    def __init__(self, cmd, env, cwd, stdout, stderr, text, start_new_session) -> None:
        self.args, self.text, self.returncode = cmd, text, None
        self.stdout = self.stderr = None
        out = err = os.devnull
        self._read: list[Path | None] = [None, None]
        if stdout is subprocess.PIPE:
            out = self._file("out")
            self._read[0] = Path(out)
        if stderr is subprocess.PIPE:
            err = self._file("err")
            self._read[1] = Path(err)
        elif stderr is subprocess.STDOUT:
            err = out
        elif stderr is None and stdout is None:
            err = out = self._file("log")  # not read, but there to look at
        context = _server()
        self.process = context.Process(
            target=_child,
            args=(
                list(cmd),
                env,
                str(cwd or os.getcwd()),
                (os.devnull, out, err),
                start_new_session,
                _BASE_PATH,
            ),
        )
        self.process.start()
        self.pid = self.process.pid

    @staticmethod
    def _file(kind: str) -> str:
        fd, path = tempfile.mkstemp(prefix=f"{kind}-", dir=_outputs)
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

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
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


TORCHRUN = ["-m", "torch.distributed.run", "--standalone"]


def _ranks(cmd: list[str]) -> int | None:
    """N for ``python -m torch.distributed.run --standalone --nproc_per_node=N x.py ...``
    (no other torchrun option), else None."""
    if cmd[1:4] != TORCHRUN or len(cmd) < 6 or not cmd[5].endswith(".py"):
        return None
    flag, _, n = cmd[4].partition("=")
    return int(n) if flag == "--nproc_per_node" and n.isdigit() else None


class ForkedRanks:
    """The ranks of ``torchrun --standalone --nproc_per_node=N script ...`` for a run that is
    to succeed (:func:`popen`'s ``forked_ranks``): N processes forked as :class:`Forked`,
    each with the environment torchrun gives a rank (its variables, ``OMP_NUM_THREADS=1``,
    unbuffered output) and rank 0 hosting the rendezvous store, as ``env://`` does without
    torchrun's agent. No agent process, no interpreter starts: on the 2-core machine an
    agent and two ranks cost about 8 s of CPU to start. The exit status is 0 when every rank
    ends with 0, else 1 after the others are killed (torchrun's ``ChildFailedError`` without
    its report); the output is each rank's, in rank order. The tests of torchrun itself
    (restarts, a rank that fails or hangs, signals, two nodes) start torchrun."""

    def __init__(self, cmd: list[str], n: int, env: dict[str, str], cwd: Any, text: bool):
        self.args, self.text, self.returncode = cmd, text, None
        with socket.socket() as s:  # a free port for rank 0's store
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        common = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "ROLE_WORLD_SIZE": str(n),
            "GROUP_WORLD_SIZE": "1",
            "GROUP_RANK": "0",
            "ROLE_NAME": "default",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": str(uuid.uuid4()),
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "PYTHONUNBUFFERED": "1",
        }
        env = {"OMP_NUM_THREADS": "1", **env, **common}
        script = [cmd[0], *cmd[5:]]
        pipe = subprocess.PIPE
        self.ranks = [
            Forked(script, {**env, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)},
                   cwd, pipe, pipe, text, False)
            for r in range(n)
        ]  # fmt: skip
        self.pid = self.ranks[0].pid
        self.stdout = self.stderr = None

    def poll(self) -> int | None:
        codes = [rank.poll() for rank in self.ranks]
        if any(code not in (None, 0) for code in codes):
            self.kill()
            for rank in self.ranks:
                rank.wait()
            self.returncode = 1
        elif all(code == 0 for code in codes):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        for rank in self.ranks:
            rank.kill()

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        self.wait(timeout)
        outs = [rank.communicate() for rank in self.ranks]
        joined = ("" if self.text else b"").join
        return joined(o for o, _ in outs), joined(e for _, e in outs)


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
    forked_ranks: bool = False,
) -> Forked | ForkedRanks | subprocess.Popen:
    """:class:`subprocess.Popen` of ``cmd``, forked when it can be (module docstring);
    ``real``: a real interpreter in any case (what happens at its exit is the point);
    ``forked_ranks``: torchrun's ranks forked, without torchrun (:class:`ForkedRanks`), for a
    run that is to succeed."""
    cmd = [str(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    n = _ranks(cmd) if forked_ranks and not real else None
    if n is not None and _forkable([cmd[0], *cmd[5:]], env, False):
        return ForkedRanks(cmd, n, env, cwd, text)
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
    forked_ranks: bool = False,
) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` of ``cmd``, forked when it can be (module docstring;
    ``forked_ranks``: :func:`popen`'s)."""
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
        forked_ranks=forked_ranks,
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
