"""``repro doctor [overrides]``: which module of my model is nondeterministic on this device?

Takes the configured model and data (the same Hydra overrides as ``train.py``), one fixed
micro-batch, and three checks:

1. **fast repeats**: with determinism off (cuDNN autotuning on, nondeterministic kernels
   allowed), forward + backward several times from the same weights, with the forward
   randomness re-keyed before each, and hooks on every module recording digests of its input,
   output, the gradient arriving at its output, the gradient it sends to its input and its own
   parameters' gradients. A module is named when its input (resp. the gradient at its output)
   is bit-identical across repeats but what it computes from it is not, and no module inside
   it already explains that: the first culprit, not the modules downstream of it.
2. **strict op check**: under ``use_deterministic_algorithms(True)``, each module is run on its
   recorded input and gradient alone, so every op without a deterministic kernel is caught and
   attributed to the innermost module that calls it (not just the first one to raise).
3. **strict repeats**: as 1, under the strict flags (nondeterministic ops warn instead of
   raising so that the repeats run) and the config's NaN-fill setting (strict: off, so an op
   that reads memory it never wrote differs across repeats): what strict mode leaves
   nondeterministic.

Exit status 0 when strict mode is clean (checks 2 and 3), 1 when it is not.

``repro doctor --cost`` answers the other question, *where does strict mode cost time?*: each
leaf module alone, and the task's loss, forward + backward on its recorded input, timed under
strict flags and under fast flags (:func:`run_cost`); the modules where determinism is
expensive are named, with the replacement ``repro.components.ops`` has for them.

When strict mode stops a training run on an op without a deterministic kernel, the loop asks
:func:`explain_nondeterministic_op` for the module that called it: one line, not a traceback.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from repro.base.errors import DeterminismError
from repro.base.rng import seed_forward, seed_global_rngs
from repro.components.data import DataSplits, DeviceNormalizer, make_train_loader
from repro.components.ops import LOSS_KEY, REPLACEMENTS, replacement_for
from repro.defense.determinism import flags_restored
from repro.engine.build import Precision, Training, build_data, build_model, build_task
from repro.engine.settle import resolve_device, uses_channels_last
from repro.records.trace import tensor_bytes

LOSS = "(the task's loss)"
NONDETERMINISTIC = "does not have a deterministic implementation"


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _digest(tensors: list[torch.Tensor | None]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(b"-" if t is None else tensor_bytes(t))
    return h.hexdigest()


def set_flags(strict: bool, fill: bool = False) -> None:
    """The kernel-selection flags of determinism=strict (or of fast mode). ``fill``: NaN-fill
    new tensors (strict leaves it off, so that an op reading memory it never wrote gets
    whatever was there, and differs across the repeats instead of reading the same NaN)."""
    torch.use_deterministic_algorithms(strict, warn_only=strict)
    torch.backends.cudnn.deterministic = strict
    torch.backends.cudnn.benchmark = not strict
    torch.utils.deterministic.fill_uninitialized_memory = fill


@dataclass
class Call:
    """One call of one module during one forward/backward."""

    name: str  # qualified name ("" for the model), "name#n" for its n-th call (n >= 2) when reused
    kind: str
    module: nn.Module
    order: int
    inputs: list[tuple[torch.Tensor, bool]] = field(default_factory=list)  # (value, requires_grad)
    grad_outputs: list[torch.Tensor | None] = field(default_factory=list)
    digests: dict[str, list[torch.Tensor | None] | str] = field(default_factory=dict)


class Probe:
    """Hooks on every module of a model recording the digests of one forward + backward."""

    def __init__(self, model: nn.Module, keep_tensors: bool) -> None:
        self.model, self.keep = model, keep_tensors
        self.calls: dict[str, Call] = {}
        self.backward_order: list[str] = []
        self._counts: dict[str, int] = {}
        self._stack: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> tuple:
            n = self._counts.get(name, 0)
            self._counts[name] = n + 1
            key = name if n == 0 else f"{name}#{n + 1}"  # its 2nd call is #2
            call = Call(key, type(module).__name__, module, len(self.calls))
            self.calls[key] = call
            self._stack.append(key)
            call.digests["in"] = _digest(_tensors(args))
            if self.keep:
                call.inputs = [(t.detach().clone(), t.requires_grad) for t in _tensors(args)]
            grads_in: list[torch.Tensor | None] = []
            call.digests["gin"] = grads_in  # filled during backward

            def private(x: Any) -> Any:
                # a private copy (x * 1 is exact), so the gradient hook sees this module's
                # gradient only, not the sum over every consumer of x
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    y = x * 1
                    slot = len(grads_in)
                    grads_in.append(None)
                    y.register_hook(lambda g: grads_in.__setitem__(slot, g.detach().clone()))
                    return y
                return x

            return tuple(private(a) for a in args)

        return hook

    def _post(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            key = self._stack.pop()
            call = self.calls[key]
            outs = _tensors(output)
            call.digests["out"] = _digest(outs)
            gouts: list[torch.Tensor | None] = [None] * len(outs)
            call.digests["gout"] = gouts
            for i, t in enumerate(outs):
                if t.requires_grad:

                    def record(g: torch.Tensor, i: int = i) -> None:
                        if key not in self.backward_order:
                            self.backward_order.append(key)
                        gouts[i] = g.detach().clone()

                    t.register_hook(record)

        return hook

    def finish(self) -> None:
        """After backward: turn the recorded gradients into digests, add parameter grads."""
        for call in self.calls.values():
            if self.keep:
                call.grad_outputs = list(call.digests["gout"])
            for part in ("gin", "gout"):
                call.digests[part] = _digest(call.digests[part])
            params = [p.grad for p in call.module.parameters(recurse=False)]
            call.digests["gparam"] = _digest(params)


@dataclass
class Finding:
    module: str
    kind: str
    where: str  # "forward" or "backward" or the op name
    detail: str


@dataclass
class DoctorReport:
    device: str
    repeats: int
    modules: int
    fast: list[Finding]
    strict_ops: list[Finding]
    strict: list[Finding]
    loss_fast: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.strict_ops and not self.strict

    def format(self) -> str:
        lines = [
            f"repro doctor: {self.modules} modules, {self.repeats} repeats of forward + "
            f"backward on one batch, device {self.device}"
        ]
        sections = (
            ("fast mode (nondeterministic kernels allowed)", self.fast),
            ("strict mode: ops without a deterministic kernel", self.strict_ops),
            ("strict mode repeats", self.strict),
        )
        for title, findings in sections:
            lines.append(f"\n{title}:")
            if not findings:
                lines.append("  none" if "ops" in title else "  clean: every module bit-identical")
            for f in findings:
                lines.append(f"  {f.module or '(model)'} ({f.kind}): {f.where}: {f.detail}")
        rows = {}
        for col, findings in enumerate((self.fast, self.strict_ops, self.strict)):
            for f in findings:
                rows.setdefault((f.module, f.kind), ["ok", "ok", "ok"])[col] = (
                    f.where if col == 1 else f"differs ({f.where})"
                )
        lines.append("\nsummary:")
        header = ("module", "fast repeats", "strict op check", "strict repeats")
        table = [header] + [(m or "(model)", k, *cols) for (m, k), cols in rows.items()]
        if len(table) == 1:
            lines.append("  no module is nondeterministic on this device in either mode.")
        else:
            table = [header] + [(f"{r[0]} ({r[1]})", *r[2:]) for r in table[1:]]
            widths = [max(len(r[i]) for r in table) for i in range(4)]
            for r in table:
                cells = (c.ljust(w) for c, w in zip(r, widths, strict=True))
                lines.append(("  " + "  ".join(cells)).rstrip())
        if self.clean:
            lines.append(
                "\nverdict: strict mode is clean for this model and data on this device."
                + (" (fast mode is not: train with determinism=strict)" if self.fast else "")
            )
        else:
            lines.append("\nverdict: NOT deterministic under strict mode.")
            if self.strict_ops:
                lines.append(
                    "  ops: replace each with a deterministic equivalent (e.g. a mean over H×W "
                    "for AdaptiveAvgPool2d(1)); determinism=warn trains anyway and lists every "
                    "such op, without the bit guarantee."
                )
            if self.strict:
                lines.append(
                    "  modules: draw randomness only from the default generator (the loop "
                    "re-keys it before every micro-batch) or from repro.base.rng.keyed_generator; "
                    "an op PyTorch does not know to be nondeterministic needs replacing."
                )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _repeat(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    seed: int,
    autocast: Callable,
    loss_fn: Callable,
    keep: bool,
) -> tuple[Probe, str]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad(set_to_none=True)
    probe = Probe(model, keep)
    try:
        seed_forward(images.device, seed, 0, 0)
        with autocast():
            logits = model(images)
        loss = loss_fn(logits, labels)
        loss.backward()
        probe.finish()
    finally:
        probe.remove()
        model.load_state_dict(state)  # BatchNorm running statistics moved: put them back
    return probe, _digest([loss])


def _culprits(probes: list[Probe]) -> list[Finding]:
    """Modules whose own computation differs between repeats (see the module docstring)."""
    first = probes[0]

    def varies(key: str, part: str) -> bool:
        return any(
            key not in p.calls or p.calls[key].digests[part] != first.calls[key].digests[part]
            for p in probes[1:]
        )

    def inside(inner: str, outer: str) -> bool:
        base = lambda k: k.split("#")[0]  # noqa: E731
        return base(inner) != base(outer) and (
            base(outer) == "" or base(inner).startswith(base(outer) + ".")
        )

    fwd = [k for k in first.calls if varies(k, "out") and not varies(k, "in")]
    fwd = [k for k in fwd if not any(inside(o, k) for o in fwd)]
    bwd = [
        k
        for k in first.calls
        if (varies(k, "gin") or varies(k, "gparam"))
        and not varies(k, "gout")
        and not varies(k, "out")
        and not varies(k, "in")
    ]
    bwd = [k for k in bwd if not any(inside(o, k) for o in bwd)]
    order = {k: i for i, k in enumerate(first.backward_order)}
    bwd.sort(key=lambda k: order.get(k, len(order)))
    findings = [
        Finding(k, first.calls[k].kind, "forward", "same input, different output") for k in fwd
    ]
    for k in bwd:
        what = "parameter gradients" if varies(k, "gparam") else "input gradient"
        findings.append(
            Finding(k, first.calls[k].kind, "backward", f"same output gradient, different {what}")
        )
    return findings


def _run_alone(call: Call, autocast: Callable) -> None:
    """Forward + backward of one recorded module call, alone: on copies of its recorded
    inputs (non-leaf: a module may modify its input in place, ReLU(inplace=True)), with the
    gradient its outputs received."""
    inputs = [t.clone().requires_grad_(True) * 1 if rg else t.clone() for t, rg in call.inputs]
    with autocast():
        out = call.module(*inputs)
    pairs = [
        (o, g)
        for o, g in zip(_tensors(out), call.grad_outputs, strict=False)
        if g is not None and o.requires_grad
    ]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])


def _op_errors(probe: Probe, autocast: Callable, notes: list[str]) -> list[Finding]:
    """Run each module alone on its recorded input under strict flags; catch the ops that
    have no deterministic kernel. Reported at the innermost module calling them."""
    raised: dict[str, tuple[Call, str]] = {}
    for key, call in probe.calls.items():
        state = {k: v.clone() for k, v in call.module.state_dict().items()}
        try:
            _run_alone(call, autocast)
        except RuntimeError as err:
            if NONDETERMINISTIC in str(err):
                raised[key] = (call, str(err).split(NONDETERMINISTIC)[0].strip())
            else:
                notes.append(f"{key or '(model)'}: not checked alone ({str(err).splitlines()[0]})")
        except Exception as err:  # e.g. a module that needs keyword arguments
            notes.append(f"{key or '(model)'}: not checked alone ({type(err).__name__}: {err})")
        finally:
            call.module.load_state_dict(state)
            call.module.zero_grad(set_to_none=True)
    findings = []
    for key, (call, op) in raised.items():
        base = key.split("#")[0]
        deeper = any(
            k != key and o == op and (base == "" or k.split("#")[0].startswith(base + "."))
            for k, (_, o) in raised.items()
        )
        if not deeper:
            findings.append(Finding(key, call.kind, op, "no deterministic kernel on this device"))
    findings.sort(key=lambda f: probe.calls[f.module].order)
    return findings


def _loss_op_error(logits: torch.Tensor, labels: torch.Tensor, loss_fn: Callable) -> Finding | None:
    x = logits.detach().clone().requires_grad_(True)
    try:
        loss_fn(x, labels).backward()
    except RuntimeError as err:
        if NONDETERMINISTIC in str(err):
            op = str(err).split(NONDETERMINISTIC)[0].strip()
            return Finding(LOSS, "function", op, f"{op} has no deterministic kernel")
        raise
    return None


def first_batch(cfg: DictConfig, splits: DataSplits, device: torch.device, model: nn.Module):
    """Micro-batch 0 of step 0, as the training loop sees it (augmented, normalised, in the
    model's memory format)."""
    loader_cfg = OmegaConf.create(
        {
            "num_workers": 0,
            "pin_memory": False,
            "persistent_workers": False,
            "prefetch_factor": None,
        }
    )
    t = cfg.trainer
    loader = make_train_loader(
        splits, int(cfg.seed), int(t.batch_size), int(t.micro_batch_size), loader_cfg, False
    )
    images, labels = next(iter(loader))
    channels_last = uses_channels_last(t.channels_last, model, device)
    return DeviceNormalizer(splits, device, channels_last)(images, labels)


def run_doctor(cfg: DictConfig, repeats: int = 4, log: Callable[[str], None] = print):
    """The three checks of the module docstring, on the configured model and data."""
    if repeats < 2:
        raise ValueError("repeats must be >= 2")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", str(cfg.determinism.cublas_workspace_config))
    device = resolve_device(str(cfg.device))
    seed = int(cfg.seed)
    seed_global_rngs(seed)
    splits = build_data(cfg)
    model = build_model(cfg, splits, device)
    model.train()
    loss_fn = build_task(cfg, splits).loss
    images, labels = first_batch(cfg, splits, device, model)
    autocast = Precision(cfg.amp, device).autocast

    n_modules = sum(1 for _ in model.modules())
    notes: list[str] = []
    with flags_restored():
        log(f"fast mode: {repeats} repeats of forward + backward with hooks on {n_modules} modules")
        set_flags(strict=False)
        fast = [
            _repeat(model, images, labels, seed, autocast, loss_fn, keep=(r == 0))
            for r in range(repeats)
        ]
        fast_findings = _culprits([p for p, _ in fast])
        if len({loss for _, loss in fast}) > 1 and not fast_findings:
            fast_findings.append(Finding(LOSS, "function", "forward", "loss differs"))

        with torch.no_grad(), autocast():
            logits = model(images)  # for the loss function's own check, below
        log("strict mode: each module alone under use_deterministic_algorithms(True)")
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        probe0 = fast[0][0]
        op_findings = _op_errors(probe0, autocast, notes)
        loss_err = _loss_op_error(logits, labels, loss_fn)
        if loss_err:
            op_findings.append(loss_err)

        log(f"strict mode: {repeats} repeats (nondeterministic ops warn so that the repeats run)")
        set_flags(strict=True, fill=bool(cfg.determinism.fill_uninitialized_memory))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strict = [
                _repeat(model, images, labels, seed, autocast, loss_fn, keep=False)
                for _ in range(repeats)
            ]
        strict_findings = _culprits([p for p, _ in strict])
        if len({loss for _, loss in strict}) > 1 and not strict_findings:
            strict_findings.append(Finding(LOSS, "function", "forward", "loss differs"))
    if device.type == "cpu":
        notes.append(
            "CPU kernels are deterministic for a fixed thread count; run on the GPU "
            "you train on to check its kernels"
        )
    return DoctorReport(
        str(device), repeats, n_modules, fast_findings, op_findings, strict_findings, notes=notes
    )


# ------------------------------------------------------------------- a run stopped by strict


def explain_nondeterministic_op(
    error: BaseException, training: Training, inputs: torch.Tensor, targets: torch.Tensor
) -> None:
    """If ``error`` is strict mode refusing an op that has no deterministic kernel, raise a
    one-line :class:`DeterminismError` naming the op, the module that calls it (or the task's
    loss) and what to do; otherwise return. Finds the module as ``repro doctor`` does: one
    forward + backward with the flags off recording every module's input, then each module
    alone under strict flags."""
    text = str(error)
    if NONDETERMINISTIC not in text:
        return
    op = text.split(NONDETERMINISTIC)[0].strip().split()[-1]
    model, task = training.model, training.task
    autocast = training.precision.autocast
    where = None
    with flags_restored(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            set_flags(strict=False)
            probe, _ = _repeat(model, inputs, targets, training.seed, autocast, task.loss, True)
            with torch.no_grad(), autocast():
                outputs = model(inputs)
            torch.use_deterministic_algorithms(True)
            found = _op_errors(probe, autocast, [])
            loss = _loss_op_error(outputs, targets, task.loss)
            found += [loss] if loss else []
            where = next((f for f in found if f.where == op), found[0] if found else None)
        except Exception:  # noqa: BLE001 - the explanation must not hide the error
            where = None
    device = inputs.device.type
    if where is None:
        place, fix = "", "replace the op"
    elif where.module == LOSS:
        place = f" in the task's loss ({type(task).__name__}.loss)"
        fix = "replace it" + (f" with {REPLACEMENTS[LOSS_KEY]}" if outputs.dim() == 4 else "")
    else:
        place = f" in module {where.module or '(model)'} ({where.kind})"
        found = replacement_for(probe.calls[where.module].module)
        fix = "replace the module" + (f" with {found}" if found else "")
    raise DeterminismError(
        f"strict mode: {op} has no deterministic kernel on {device}{place}; {fix}, or train "
        "with determinism=warn to list every such op (without the bit guarantee)."
    ) from None


# ----------------------------------------------------------------------- --cost


@dataclass
class Cost:
    """One leaf module (or the task's loss): median forward + backward time, strict vs fast."""

    module: str
    kind: str
    fast_ms: float
    strict_ms: float | None  # None: strict mode raises (``raises`` names the op)
    raises: str | None = None
    replacement: str | None = None

    @property
    def speed(self) -> float | None:
        """Strict's speed over fast's (fast time / strict time): 1 costs nothing."""
        return None if self.strict_ms is None else self.fast_ms / self.strict_ms


@dataclass
class CostReport:
    device: str
    batch: str
    repeats: int
    model_fast_ms: float
    model_strict_ms: float | None
    model_raises: str | None
    costs: list[Cost]

    @property
    def raises(self) -> bool:
        """Strict mode refuses an op of the step (exit status 1)."""
        return self.model_strict_ms is None or any(c.strict_ms is None for c in self.costs)

    @property
    def expensive(self) -> list[Cost]:
        """The rows where determinism costs: strict raises, or it takes 5% of the whole
        step's fast time more and runs below 0.8 of fast's speed."""
        return [
            c
            for c in self.costs
            if c.strict_ms is None
            or (c.strict_ms - c.fast_ms > 0.05 * self.model_fast_ms and (c.speed or 1) < 0.8)
        ]

    def format(self, rows: int = 12) -> str:
        whole = (
            f"raises ({self.model_raises})"
            if self.model_strict_ms is None
            else f"strict {self.model_strict_ms:.3f} ms, speed strict / fast "
            f"{self.model_fast_ms / self.model_strict_ms:.2f}"
        )
        lines = [
            f"repro doctor --cost: forward + backward, strict vs fast, device {self.device}, "
            f"batch {self.batch}, median of {self.repeats}",
            f"whole model + loss: fast {self.model_fast_ms:.3f} ms, {whole}",
            "",
        ]
        excess = lambda c: float("inf") if c.strict_ms is None else c.strict_ms - c.fast_ms  # noqa: E731
        shown = sorted(self.costs, key=excess, reverse=True)[:rows]
        table = [("module", "kind", "fast ms", "strict ms", "strict / fast")]
        for c in shown:
            strict = "raises" if c.strict_ms is None else f"{c.strict_ms:.3f}"
            speed = "-" if c.speed is None else f"{c.speed:.2f}"
            table.append((c.module, c.kind, f"{c.fast_ms:.3f}", strict, speed))
        widths = [max(len(r[i]) for r in table) for i in range(5)]
        for r in table:
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
        if len(self.costs) > rows:
            lines.append(f"  ... {len(self.costs) - rows} more (less strict-mode excess)")
        lines.append("")
        if self.model_strict_ms is None and not any(c.strict_ms is None for c in self.costs):
            lines.append(
                f"strict mode raises in the whole model ({self.model_raises}) but in no module "
                "alone: the op is in a forward outside the modules; repro doctor finds it."
            )
        elif not self.expensive:
            lines.append(
                "verdict: determinism is cheap here: no module is expensive in strict mode."
            )
        for c in self.expensive:
            what = (
                f"raises: {c.raises}" if c.strict_ms is None else f"{c.speed:.2f} of fast's speed"
            )
            fix = f"; use {c.replacement}" if c.replacement else ""
            lines.append(f"expensive: {c.module} ({c.kind}): {what}{fix}")
        lines.append(
            "note: modules are timed alone; the whole-model line includes what runs outside them."
        )
        return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return 1000 * (time.perf_counter() - start)


def _module_pass(call: Call, autocast: Callable) -> Callable[[], None]:
    """Forward + backward of one recorded module call, alone (:func:`_run_alone`)."""

    def run() -> None:
        _run_alone(call, autocast)
        call.module.zero_grad(set_to_none=True)

    return run


def _both_modes(
    fn: Callable[[], None], device: torch.device, repeats: int
) -> tuple[float, float | None, str | None]:
    """(fast ms, strict ms or None, the op strict mode refuses or None): medians over
    ``repeats`` calls in each mode, alternating, after two warm-up calls in each (cuDNN
    autotunes in fast mode)."""

    def mode(strict: bool) -> None:
        set_flags(strict=strict)
        torch.use_deterministic_algorithms(strict, warn_only=False)

    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for r in range(repeats + 2):
            for strict in (False, True):
                mode(strict)
                ms = _once(fn, device)
                if r >= 2:
                    times[strict].append(ms)
    except RuntimeError as err:
        if NONDETERMINISTIC not in str(err) or not torch.are_deterministic_algorithms_enabled():
            raise
        mode(False)
        fast = statistics.median([_once(fn, device) for _ in range(repeats)])
        return fast, None, str(err).split(NONDETERMINISTIC)[0].strip().split()[-1]
    return statistics.median(times[False]), statistics.median(times[True]), None


def run_cost(cfg: DictConfig, repeats: int = 10, log: Callable[[str], None] = print) -> CostReport:
    """Time each leaf module of the configured model, and the task's loss, forward +
    backward, under strict and fast flags, on micro-batch 0 of step 0."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", str(cfg.determinism.cublas_workspace_config))
    device = resolve_device(str(cfg.device))
    seed = int(cfg.seed)
    seed_global_rngs(seed)
    splits = build_data(cfg)
    model = build_model(cfg, splits, device)
    model.train()
    task = build_task(cfg, splits)
    images, labels = first_batch(cfg, splits, device, model)
    autocast = Precision(cfg.amp, device).autocast
    state = {k: v.clone() for k, v in model.state_dict().items()}
    costs = []
    with flags_restored(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        set_flags(strict=False)
        probe, _ = _repeat(model, images, labels, seed, autocast, task.loss, keep=True)
        with torch.no_grad(), autocast():
            logits = model(images)

        def whole() -> None:
            seed_forward(device, seed, 0, 0)
            with autocast():
                out = model(images)
            task.loss(out, labels).backward()
            model.zero_grad(set_to_none=True)

        log(f"timing the whole model + loss, strict vs fast, {repeats} repeats each")
        model_fast, model_strict, model_raises = _both_modes(whole, device, repeats)
        leaves = [c for c in probe.calls.values() if not any(True for _ in c.module.children())]
        log(f"timing {len(leaves)} leaf module calls and the loss, strict vs fast")
        for call in leaves:
            fast, strict, raises = _both_modes(_module_pass(call, autocast), device, repeats)
            costs.append(
                Cost(call.name, call.kind, fast, strict, raises, replacement_for(call.module))
            )

        def loss_pass() -> None:
            x = logits.detach().clone().requires_grad_(True)
            task.loss(x, labels).backward()

        fast, strict, raises = _both_modes(loss_pass, device, repeats)
        costs.append(
            Cost(
                LOSS,
                type(task).__name__,
                fast,
                strict,
                raises,
                REPLACEMENTS[LOSS_KEY] if logits.dim() == 4 else None,
            )
        )
    model.load_state_dict(state)
    batch = "×".join(str(d) for d in images.shape)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return CostReport(
        f"{device} ({name})", batch, repeats, model_fast, model_strict, model_raises, costs
    )
