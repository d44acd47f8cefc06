"""Imported at interpreter start when this folder is on PYTHONPATH (the kill-storm test):
every fsync takes 0.3 s longer, so a checkpoint's temporary file exists long enough for the
test to kill the run in the middle of writing it."""

import os
import time

_fsync = os.fsync


def _slow_fsync(fd):
    time.sleep(0.3)
    return _fsync(fd)


os.fsync = _slow_fsync
