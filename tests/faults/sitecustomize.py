"""Faults injected into the ``train.py`` processes of the resume tests: imported at
interpreter start when this folder is on ``PYTHONPATH``, each switched on by a variable.

``REPRO_FAULT_SLOW_FSYNC=0.3``
    every fsync takes 0.3 s longer, so a checkpoint's temporary file exists long enough for
    a test to kill the run in the middle of writing it;
``REPRO_FAULT_KILL_AFTER_RENAME=step-00000010.pt``
    the process SIGKILLs itself right after a file of that name is renamed into place:
    before its checksum sidecar is written, at that exact point, not by timing.
"""

import os
import signal
import time

_delay = float(os.environ.get("REPRO_FAULT_SLOW_FSYNC") or 0)
_kill_after = os.environ.get("REPRO_FAULT_KILL_AFTER_RENAME")

if _delay:
    _fsync = os.fsync

    def _slow_fsync(fd):
        time.sleep(_delay)
        return _fsync(fd)

    os.fsync = _slow_fsync

if _kill_after:
    _replace = os.replace

    def _replace_then_die(src, dst, *args, **kwargs):
        _replace(src, dst, *args, **kwargs)
        if os.path.basename(os.fspath(dst)) == _kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = _replace_then_die
