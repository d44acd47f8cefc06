"""The tests' own launcher (tests/launch.py): what it leaves behind."""

import os
import subprocess
import sys

from conftest import ROOT

# a process that forks a child, which forks a grandchild, each capturing its child's output
# through the launcher's files (forked here: no preloaded server, no torch)
NESTED = """
import os, subprocess, sys
import launch

launch._server()  # the paths a forked process is given (no server starts until one is used)
inner = (
    "import os, subprocess, sys, launch; "
    "p = launch.Forked([sys.executable, '-c', 'print(2)'], dict(os.environ), None, "
    "subprocess.PIPE, None, True, False, here=True); print(p.communicate()[0].strip())"
)
p = launch.Forked([sys.executable, "-c", inner], dict(os.environ), None, subprocess.PIPE,
                  None, True, False, here=True)
out = p.communicate()[0].strip()
print(out, p.returncode, sorted(os.listdir(os.environ["TMPDIR"])) != [])
"""


def test_the_launchers_output_files_go_with_the_processes_that_made_them(tmp_path):
    """Each process that captures a forked child's output makes a folder for it and removes
    it as it ends, an interpreter or a forked process alike: nothing is left in TMPDIR."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT / "tests")}
    done = subprocess.run(
        [sys.executable, "-c", NESTED], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "0", "True"]  # the folders existed while it ran
    assert sorted(p.name for p in tmp_path.iterdir()) == []
