"""``repro compare RUN_A RUN_B``: are two runs bit-identical, and if not, where do they part?

Reads what every run writes (``trace.jsonl``, ``env.json``, ``checkpoint.pt``). Exact mode
walks the steps in order and reports the first step at which anything differs, in causal order
within the step: the batch's data, the learning rate, the loss, the gradient norm, then the
state-dict tensors digested after the update. ``tolerance`` mode (for runs on different
hardware, which cannot be bit-equal) reports the largest loss-curve and final-metric
deviations instead.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repro.base.errors import ReproError
from repro.base.files import ENV_FILE, TRACE_FILE, parse_json, parse_trace_record
from repro.defense.config import flatten

# Differences in these are listed but are expected between any two runs.
_VOLATILE = ("git.",)
# Environment differences are listed in this order: what decides the kernels first.
_ENV_ORDER = ("environment.", "flags.", "env_vars.", "git.")
_MAX_LISTED = 12
# The headline metric of runs whose trace predates the task record.
_DEFAULT_HEADLINE = "val_accuracy"


@dataclass
class RunRecords:
    dir: Path
    steps: list[dict[str, Any]]  # index i holds step i (0: initial weights)
    env: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        return len(self.steps) - 1

    @property
    def config(self) -> dict[str, Any]:
        return (self.env or {}).get("config") or {}

    @property
    def headline(self) -> str:
        """The task's headline metric (recorded with the initial weights)."""
        return (self.steps[0].get("task") or {}).get("headline", _DEFAULT_HEADLINE)


@dataclass
class Comparison:
    identical: bool
    lines: list[str]

    @property
    def exit_code(self) -> int:
        return 0 if self.identical else 1

    def text(self) -> str:
        return "\n".join(self.lines)


def load_run(path: str | Path) -> RunRecords:
    """Read a run directory; one clear error when it is not one."""
    path = Path(path)
    if not path.exists():
        raise ReproError(f"{path}: no such run directory.")
    if not path.is_dir():
        raise ReproError(f"{path}: not a directory; give a run directory (it holds {TRACE_FILE}).")
    trace = path / TRACE_FILE
    if not trace.is_file():
        raise ReproError(
            f"{path}: no {TRACE_FILE}; not a train.py run directory, or it ran with "
            "trainer.trace=false."
        )
    # bytes that are not UTF-8 (a write cut short, a damaged disk) become U+FFFD, so the
    # line they are in is reported like any other line that is not a record
    text = trace.read_bytes().decode("utf-8", errors="replace")
    lines = text.splitlines()
    notes, steps = [], []
    for n, line in enumerate(lines, 1):
        try:
            record = parse_trace_record(line)
            step = record["step"]
        except ValueError as err:
            if n == len(lines) and not text.endswith("\n"):
                notes.append(f"{trace}: last line cut short (killed while writing); ignored")
                break
            raise ReproError(
                f"{trace}:{n}: not a trace record ({type(err).__name__}: {err}); "
                "the file is damaged."
            ) from None
        if step != len(steps):
            raise ReproError(
                f"{trace}:{n}: step {step} where step {len(steps)} was expected; "
                "the file is damaged or was written by two runs."
            )
        steps.append(record)
    if not steps:
        raise ReproError(f"{trace}: empty; the run stopped before its first record.")
    env = None
    if (path / ENV_FILE).is_file():
        try:
            env = parse_json((path / ENV_FILE).read_bytes())
            if not isinstance(env, dict):
                raise ValueError("not a JSON object")
            for key in ("config", "environment", "flags", "env_vars", "git"):
                if env.get(key) is not None and not isinstance(env[key], dict):
                    raise ValueError(f"its {key!r} is a {type(env[key]).__name__}, not an object")
        except ValueError as err:
            raise ReproError(
                f"{path / ENV_FILE}: not a run's record ({err}); the file is damaged."
            ) from None
    else:
        notes.append(f"{path}: no {ENV_FILE}; environment and config not compared")
    return RunRecords(path, steps, env, notes)


def _bits(x: Any) -> Any:
    """A value's identity for comparison: floats by their IEEE bits (so -0.0 != 0.0, NaN == NaN)."""
    if isinstance(x, float):
        return struct.pack(">d", x)
    return x


def _dict_diff(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Entries that differ; an entry one side lacks and the other has as None (an unset
    variable, say) does not."""
    fa, fb = flatten(a), flatten(b)
    missing = object()
    diffs = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, missing), fb.get(key, missing)
        if {id(va), id(vb)} <= {id(missing), id(None)}:
            continue
        if _bits(va) != _bits(vb):
            diffs.append(
                (key, "(absent)" if va is missing else va, "(absent)" if vb is missing else vb)
            )
    return diffs


def context_differences(a: RunRecords, b: RunRecords) -> tuple[list[str], list[str]]:
    """Config entries and environment entries (versions, hardware, flags, variables, git)
    that differ, as ``key: A vs B`` lines."""
    if a.env is None or b.env is None:
        return [], []

    def lines(diffs):
        return [f"{k}: {va} vs {vb}" for k, va, vb in diffs]

    config = lines(_dict_diff(a.config, b.config))
    env_a = {k: v for k, v in a.env.items() if k not in ("config", "config_hash")}
    env_b = {k: v for k, v in b.env.items() if k not in ("config", "config_hash")}
    env = lines(_dict_diff(env_a, env_b))
    env.sort(key=lambda line: next((i for i, p in enumerate(_ENV_ORDER) if line.startswith(p)), 9))
    return config, env


def _listing(config: list[str], env: list[str], suffix: str = "") -> list[str]:
    """The config and environment differences as indented lines (at most _MAX_LISTED each)."""
    lines = []
    for what, items in (("config", config), ("environment", env)):
        if items:
            lines.append(f"  {what} differs ({len(items)}){suffix}:")
            lines += [f"    {item}" for item in items[:_MAX_LISTED]]
            if len(items) > _MAX_LISTED:
                lines.append(f"    … and {len(items) - _MAX_LISTED} more")
    return lines


def _fmt(x: Any) -> str:
    return f"{x:.10g}" if isinstance(x, float) else str(x)


def _deviation(x: float, y: float) -> tuple[float, float]:
    diff = abs(x - y)
    scale = max(abs(x), abs(y))
    return diff, (diff / scale if scale else 0.0)


def step_differences(ra: dict[str, Any], rb: dict[str, Any]) -> list[str]:
    """What differs between two records of the same step, in causal order."""
    found = []
    ba, bb = ra.get("batch"), rb.get("batch")
    if ba and bb:
        for part in ("inputs", "labels"):
            if ba.get(part) != bb.get(part):
                found.append(f"batch {part} (data: {ba.get(part)[:12]}… vs {bb.get(part)[:12]}…)")
    for key in ("lr", "loss", "grad_norm"):
        if key in ra and key in rb and _bits(ra[key]) != _bits(rb[key]):
            diff, rel = _deviation(ra[key], rb[key])
            found.append(
                f"{key} {_fmt(ra[key])} vs {_fmt(rb[key])} (abs {diff:.3g}, rel {rel:.3g})"
            )
    ta, tb = ra.get("tensors"), rb.get("tensors")
    if ta is not None and tb is not None:
        names = [k for k in ta if ta.get(k) != tb.get(k)]
        names += [k for k in tb if k not in ta]
        if names:
            more = f" (and {len(names) - 1} more of {len(ta)})" if len(names) > 1 else ""
            found.append(f"tensor {names[0]}{more}")
    return found


def _checkpoint_deviation(a: RunRecords, b: RunRecords) -> str | None:
    """Max abs / relative difference of the final weights, from the two checkpoints."""
    paths = []
    for run in (a, b):
        name = (run.config.get("trainer") or {}).get("checkpoint_name", "checkpoint.pt")
        paths.append(run.dir / name)
    if not all(p.is_file() for p in paths):
        return None
    import torch  # only here: comparing two traces needs no torch

    try:
        sa, sb = (torch.load(p, map_location="cpu", weights_only=True)["model"] for p in paths)
    except Exception:  # a foreign or damaged checkpoint only loses this one line
        return None
    worst = (0.0, 0.0, "")
    for key in sorted(set(sa) & set(sb)):
        x, y = sa[key], sb[key]
        if x.shape != y.shape or not x.is_floating_point():
            continue
        diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        if diff > worst[0]:
            scale = max(x.double().abs().max().item(), y.double().abs().max().item())
            worst = (diff, diff / scale if scale else 0.0, key)
    if not worst[2]:
        return None
    return f"final weights: max abs diff {worst[0]:.3g} (rel {worst[1]:.3g}) in {worst[2]}"


def compare_runs(a: RunRecords, b: RunRecords) -> Comparison:
    """Exact comparison: identical bits, or the first divergent step and what diverged."""
    common = min(a.last_step, b.last_step)
    if common == 0:
        short = a if a.last_step == 0 else b
        return Comparison(False, [f"nothing to compare: {short.dir} has no optimizer step yet"])
    lines: list[str] = []
    first: tuple[int, list[str]] | None = None
    last_agreeing_digest = None
    for step in range(common + 1):
        ra, rb = a.steps[step], b.steps[step]
        found = step_differences(ra, rb)
        if found:
            first = (step, found)
            break
        if "tensors" in ra and "tensors" in rb:
            last_agreeing_digest = step
    config, env = context_differences(a, b)
    length_note = ""
    if a.last_step != b.last_step:
        length_note = (
            f" (common prefix: {a.dir} has {a.last_step} steps, {b.dir} has {b.last_step})"
        )

    if first is None:
        rec = a.steps[common]
        weights = rec.get("weights_sha256")
        if weights is None:
            last = max((i for i in range(common + 1) if "weights_sha256" in a.steps[i]), default=0)
            weights = f"{a.steps[last]['weights_sha256']} (last digest: step {last})"
        lines.append(f"identical: {common} steps, weights {weights}{length_note}")
        lines += _listing(config, env, ", the bits do not")
        lines += [f"  note: {n}" for n in a.notes + b.notes]
        return Comparison(True, lines)

    step, found = first
    where = "initial weights" if step == 0 else f"step {step}"
    lines.append(f"differ: first divergence at {where}{length_note}")
    lines.append(f"  first: {found[0]}")
    lines += [f"  also:  {f}" for f in found[1:]]
    if step > 0 and last_agreeing_digest is not None:
        lines.append(f"  all tensors last agreed at step {last_agreeing_digest} (digested then)")
    loss = _loss_deviation(a, b, common)
    if loss:
        lines.append(f"  loss: largest deviation {loss}")
    ckpt = _checkpoint_deviation(a, b) if a.last_step == b.last_step else None
    if ckpt:
        lines.append(f"  {ckpt}")
    lines += _listing(config, env)
    if not config and not [e for e in env if not e.startswith(_VOLATILE)]:
        lines.append("  same config and environment: a nondeterministic op? try `repro doctor`")
    lines += [f"  note: {n}" for n in a.notes + b.notes]
    return Comparison(False, lines)


def _loss_deviation(a: RunRecords, b: RunRecords, common: int) -> str | None:
    worst = None
    for step in range(1, common + 1):
        la, lb = a.steps[step].get("loss"), b.steps[step].get("loss")
        if la is None or lb is None or math.isnan(la) or math.isnan(lb):
            continue
        diff, rel = _deviation(la, lb)
        if worst is None or diff > worst[1]:
            worst = (step, diff, rel, la, lb)
    if worst is None or worst[1] == 0:
        return None
    step, diff, rel, la, lb = worst
    return f"at step {step}: {_fmt(la)} vs {_fmt(lb)} (abs {diff:.3g}, rel {rel:.3g})"


def _final_metrics(run: RunRecords, upto: int) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for step in range(1, upto + 1):
        rec = run.steps[step]
        if "loss" in rec:
            out["loss"] = (step, rec["loss"])
        for key, value in (rec.get("eval") or {}).items():
            out[key] = (step, value)
    return out


def compare_tolerance(a: RunRecords, b: RunRecords, rtol: float) -> Comparison:
    """Within ``rtol`` or not: the loss curve's largest relative deviation and the headline
    metric's absolute difference at the last common evaluation (headlines are fractions such
    as accuracy). The other metrics are listed beside them."""
    common = min(a.last_step, b.last_step)
    if common == 0:
        short = a if a.last_step == 0 else b
        return Comparison(False, [f"nothing to compare: {short.dir} has no optimizer step yet"])
    lines, ok = [], True
    worst = None
    for step in range(1, common + 1):
        la, lb = a.steps[step].get("loss"), b.steps[step].get("loss")
        if la is None or lb is None:
            continue
        diff, rel = _deviation(la, lb)
        if math.isnan(diff):
            rel = math.inf
        if worst is None or rel > worst[2]:
            worst = (step, diff, rel)
    detail = []
    if worst is not None:
        ok &= worst[2] <= rtol
        detail.append(
            f"  loss curve ({common} steps): largest deviation at step {worst[0]}: "
            f"abs {worst[1]:.3g}, rel {worst[2]:.3g}"
        )
    fa, fb = _final_metrics(a, common), _final_metrics(b, common)
    headline = a.headline
    for run, found in ((a, fa), (b, fb)):
        if headline not in found:
            ok = False
            detail.append(f"  {headline} (the headline): no evaluation in {run.dir} to compare")
    for key in sorted(set(fa) & set(fb), key=lambda k: k != headline):
        (sa, va), (_, vb) = fa[key], fb[key]
        diff, rel = _deviation(va, vb)
        checked = "headline, abs checked" if key == headline else "listed"
        if key == headline:
            ok &= diff <= rtol
        detail.append(
            f"  {key} (step {sa}): {_fmt(va)} vs {_fmt(vb)}: abs {diff:.3g}, rel {rel:.3g}"
            f" ({checked})"
        )
    length_note = (
        f" over the common prefix of {common} steps ({a.dir}: {a.last_step}, {b.dir}: "
        f"{b.last_step})"
        if a.last_step != b.last_step
        else ""
    )
    verdict = "within" if ok else "outside"
    lines.append(f"{verdict} tolerance {rtol:g}{length_note}")
    lines += detail
    lines += _listing(*context_differences(a, b))
    lines += [f"  note: {n}" for n in a.notes + b.notes]
    return Comparison(ok, lines)


def compare_dirs(a: str | Path, b: str | Path, tolerance: float | None = None) -> Comparison:
    ra, rb = load_run(a), load_run(b)
    return compare_runs(ra, rb) if tolerance is None else compare_tolerance(ra, rb, tolerance)
