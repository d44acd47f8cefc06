"""The progress bar: on a TTY only, never under CI=true."""

import io

from repro.base.progress import Progress


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_tty(monkeypatch):
    out = FakeTTY()
    monkeypatch.setattr("sys.stderr", out)
    monkeypatch.delenv("CI", raising=False)
    bar = Progress(10)
    bar.update(3, loss="0.5")
    bar.close()
    bar.close()
    assert "3/10" in out.getvalue() and "loss 0.5" in out.getvalue()
    assert out.getvalue().endswith("\033[K\n")  # one newline, however often it is closed


def test_progress_bar_is_quiet_under_ci_and_in_pipes(monkeypatch):
    out = FakeTTY()
    monkeypatch.setattr("sys.stderr", out)
    monkeypatch.setenv("CI", "true")
    Progress(10).update(3)
    assert out.getvalue() == ""
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    monkeypatch.delenv("CI")
    Progress(10).update(3)
    assert pipe.getvalue() == ""
