"""Optional packages in the tests: a test that needs one skips, with the reason, where it is
absent *or* unusable -- installed but raising on import, as a torchvision built for another
torch does (``RuntimeError: operator torchvision::nms does not exist``). A fork's environment
may hold any of them, in any state: no test assumes one absent.

``pytest.importorskip`` catches ImportError only, and ``importlib.util.find_spec`` says
nothing about whether the import works; these import, in this process, catching anything."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def usable(module: str) -> str | None:
    """None when ``import module`` works here, else why not: "not installed", or "installed
    but its import fails: Type: message"."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and (module == err.name or module.startswith(f"{err.name}.")):
            return "not installed"
        return f"installed but its import fails: {_said(err)}"
    except Exception as err:
        return f"installed but its import fails: {_said(err)}"
    return None


def require(module: str, hint: str = "") -> ModuleType:
    """``module``, imported; or skip the test (or the whole file, at module level) saying why
    it is not usable, and ``hint``: how to install it."""
    __tracebackhide__ = True  # the skip is reported at the test's line, not here
    why = usable(module)
    if why is not None:
        pytest.skip(f"needs {module}: {why}{f' ({hint})' if hint else ''}", allow_module_level=True)
    return importlib.import_module(module)


def _said(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"
