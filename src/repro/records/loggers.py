"""Where a run's metrics go: the ``logger`` config group (``conf/logger/``).

``logger=csv`` (the default) writes ``metrics.csv`` and ``eval.csv`` into the run directory;
``tensorboard``, ``mlflow`` and ``wandb`` send the same values to those tools, and
``logger=[csv,tensorboard]`` chooses several. Each chosen logger is built from its
``_target_`` on rank 0 only, and receives, in this order:

- ``start``: the run's metadata (the resolved config, the determinism report, the
  environment fingerprint ``env.json``), and where a resumed run starts;
- ``log_steps``: every step's loss, gradient norm and learning rate, as the loop flushes
  them (every ``trainer.log_every`` steps, at evaluations and before checkpoints);
- ``log_eval``: every evaluation's metrics;
- ``finish``: the run's summary (``summary.json``: the weights' digest, the test metrics);
- ``close``: always, also when the run stops early (preempted, diverged, crashed).

A logger reads values the loop has already computed and never touches the training, so the
bits are those of a run without it (``tests/test_loggers.py``). The exact record stays
``trace.jsonl``; TensorBoard keeps scalars as float32.

Your own logger: a class with :class:`Logger`'s methods (each may be left as it is here:
nothing) in your module, and ``conf/logger/<name>.yaml`` holding
``<name>: {_target_: your.module.YourLogger, ...}``. A package it needs is named in
``requires``: a run without it stops before anything is written, with the ``pip install``.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import io
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from repro.base.errors import ConfigError, MissingPackage
from repro.base.files import (
    EVAL_FILE,
    LOGGERS_FILE,
    METRICS_FILE,
    TRACE_FILE,
    finite_or_null,
    open_run_file,
    parse_json,
    parse_trace_record,
    write_file,
)
from repro.defense.config import RUN_CONTROL, flatten

log = logging.getLogger("repro")
METRICS_FIELDS = ["step", "epoch", "loss", "grad_norm", "lr"]


@dataclass(frozen=True)
class RunInfo:
    """What a logger is told at the start of a run."""

    run_dir: Path
    config: dict[str, Any]  # the resolved config
    metadata: list[Path]  # determinism.json, determinism.txt, env.json (env-resume-N.json)
    metric_names: list[str]  # the evaluation's, in order (eval.csv's columns)
    start: int  # the step the run starts after: 0, or the checkpoint's when resumed
    resumed: bool


class Logger:
    """A logger's interface. Rows are ``{"step", "epoch", "loss", "grad_norm", "lr"}``;
    values are Python floats, possibly not finite (``trainer.on_nonfinite=continue``)."""

    # (module, extra): the module must be importable, else the run stops before it starts
    # with ``pip install -e '.[extra]'``
    requires: ClassVar[tuple[str, str] | None] = None
    # True: an error of this logger stops the run (else: it is warned about and dropped)
    essential: ClassVar[bool] = False

    def start(self, info: RunInfo) -> None:
        pass

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        pass

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def flush(self) -> None:
        """On disk (or sent) now: before a preempted run hands its signal over."""

    def finish(self, summary: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class Loggers:
    """The run's chosen loggers, each called in turn; empty on ranks other than 0 and
    before :meth:`open`.

    A logger that fails while the run trains (a tracking server gone, a full disk under
    its files) is warned about once, closed and dropped, and the run goes on: the values
    are still in ``trace.jsonl`` (and the CSVs). Only a logger marked ``essential`` (the
    CSVs) stops the run with its error; so does any logger that fails to start."""

    def __init__(self) -> None:
        self.chosen: list[tuple[str, Logger]] = []

    def open(self, node: Any, info: RunInfo) -> None:
        """Build every entry of ``cfg.logger`` (a mapping ``name -> {_target_: ...}``) and
        start it."""
        from hydra.utils import instantiate

        for name, entry in (node or {}).items():
            logger = instantiate(entry, _convert_="all")
            self.chosen.append((str(name), logger))  # closed even if its start fails
            logger.start(info)

    def _each(self, call: Callable[[Logger], Any]) -> None:
        for name, logger in list(self.chosen):
            try:
                call(logger)
            except Exception as err:
                if logger.essential:
                    raise
                self.chosen.remove((name, logger))
                log.warning(
                    f"logger {name} failed ({type(err).__name__}: {err}); the run goes on "
                    "without it (trace.jsonl holds every value)"
                )
                _close(name, logger)

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        self._each(lambda logger: logger.log_steps([dict(r) for r in rows]))

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._each(lambda logger: logger.log_eval(step, dict(metrics)))

    def flush(self) -> None:
        self._each(lambda logger: logger.flush())

    def finish(self, summary: dict[str, Any]) -> None:
        self._each(lambda logger: logger.finish(summary))

    def close(self) -> None:
        """Close every logger; one that fails to close is warned about, so that it neither
        hides the run's own error nor keeps the others open."""
        chosen, self.chosen = self.chosen, []
        for name, logger in chosen:
            _close(name, logger)


def _close(name: str, logger: Logger) -> None:
    try:
        logger.close()
    except Exception as err:  # reported; the run's own error (if any) stays the one raised
        log.warning(f"logger {name}: closing failed ({type(err).__name__}: {err})")


def fingerprint(info: RunInfo) -> str:
    """The run's config, less what only says how it was launched (a resume), as a digest:
    what a logger's run remembered in ``loggers.json`` must match to be continued."""
    kept = {k: v for k, v in flatten(info.config).items() if k not in RUN_CONTROL}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def continues(held: dict[str, Any], info: RunInfo) -> bool:
    """Does the run a logger remembered continue here? A resumed run's does; one started
    again from step 0 in its directory (killed before its first checkpoint) does when its
    config is the remembered one's, and otherwise gets a run of its own."""
    return info.resumed or held.get("config") == fingerprint(info)


def remembered(run_dir: Path, name: str) -> dict[str, Any] | None:
    """What logger ``name`` wrote into the run directory's ``loggers.json`` (the ids that
    let a resumed run continue the same MLflow or W&B run)."""
    held = _loggers_json(run_dir / LOGGERS_FILE).get(name)
    return held if isinstance(held, dict) else None


def _loggers_json(path: Path) -> dict[str, Any]:
    """``loggers.json``; ``{}`` where it is missing or damaged (:func:`parse_json`)."""
    try:
        held = parse_json(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return held if isinstance(held, dict) else {}


def remember(run_dir: Path, name: str, value: dict[str, Any]) -> None:
    path = run_dir / LOGGERS_FILE
    held = _loggers_json(path)
    text = json.dumps({**held, name: value}, indent=2) + "\n"
    write_file(path, text)


class CsvLog:
    """Append rows to a CSV in the run directory; floats as ``repr`` (round-trip exact).

    ``resume_at=s`` (a resumed run) keeps the rows of steps <= s already there -- up to the
    first row that is cut short or garbled -- and appends. ``expected``: the steps <= s the
    file must hold; those missing (a file truncated or deleted) are taken from ``rebuild``
    (step -> row, from ``trace.jsonl``), or named in one warning."""

    def __init__(
        self,
        path: Path,
        fields: list[str],
        resume_at: int | None = None,
        expected: list[int] | None = None,
        rebuild: Callable[[list[int]], dict[int, list[Any]]] | None = None,
    ) -> None:
        if resume_at is not None:
            rows = {int(r[0]): r for r in _clean_rows(path, fields, resume_at)}
            missing = [s for s in expected or [] if s not in rows]
            found = rebuild(missing) if rebuild and missing else {}
            rows.update({s: _formatted(r) for s, r in found.items()})
            if found:
                log.warning(
                    f"{path.name}: steps {_ranges(sorted(found))} rebuilt from {TRACE_FILE}"
                )
            lost = [s for s in missing if s not in found]
            if lost:
                log.warning(
                    f"{path.name}: steps {_ranges(lost)} are missing (cut from the file, and not "
                    f"in {TRACE_FILE} either): the file has a gap there"
                )
            buf = io.StringIO()
            csv.writer(buf).writerows([fields, *(rows[s] for s in sorted(rows))])
            write_file(path, buf.getvalue())
            self.file = open_run_file(path, "a", newline="")  # never through a link
            self.writer = csv.writer(self.file)
        else:
            self.file = open_run_file(path, "w", newline="")
            self.writer = csv.writer(self.file)
            self.writer.writerow(fields)
        self.file.flush()

    def write(self, rows: list[list[Any]]) -> None:
        try:
            self.writer.writerows([_formatted(r) for r in rows])
            self.file.flush()
        except OSError as err:  # a full disk: name the file
            raise OSError(err.errno, err.strerror, str(self.file.name)) from None

    def close(self) -> None:
        self.file.close()


def _formatted(row: list[Any]) -> list[Any]:
    return [repr(v) if isinstance(v, float) else v for v in row]


def _clean_rows(path: Path, fields: list[str], up_to: int) -> list[list[str]]:
    """The rows of a CSV log with steps rising up to ``up_to``, until the first one that is
    not a whole row (cut short by a kill, or garbage appended: bytes that are not UTF-8
    become U+FFFD and fail the check like any other bad row)."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return []
    kept, last, reader = [], 0, csv.reader(io.StringIO(text, newline=""))
    next(reader, None)  # the header
    while True:
        try:
            r = next(reader)
        except (StopIteration, csv.Error):  # csv.Error: a NUL byte, say
            return kept
        if len(r) != len(fields) or not r[0].isdigit() or not last < int(r[0]) <= up_to:
            return kept
        if any("\ufffd" in v for v in r):
            return kept
        kept.append(r)
        last = int(r[0])


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(f"{start}-{s}" if s != start else str(s))
            start = None
    return ", ".join(out)


def _trace_records(run_dir: Path, up_to: int) -> dict[int, dict[str, Any]]:
    """The records of ``trace.jsonl`` for steps 1 .. ``up_to``, until its first line that is
    not a record (:func:`repro.base.files.parse_trace_record`): named in a warning where it comes
    before step ``up_to``, for no row is rebuilt from there on."""
    path = run_dir / TRACE_FILE
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return {}
    records: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        try:
            record = parse_trace_record(line)
        except ValueError as err:
            if up_to not in records:
                after = f" (after step {max(records)})" if records else ""
                log.warning(
                    f"{path}:{n}{after}: not a trace record ({err}); no row is rebuilt from "
                    "it or the lines after it"
                )
            break
        if 1 <= record["step"] <= up_to:
            records[record["step"]] = record
    return records


class CsvLogger(Logger):
    """``metrics.csv`` (a row per step) and ``eval.csv`` (a row per evaluation) in the run
    directory, floats written with ``repr`` (exact). ``repro report`` draws its curves
    from them; a resumed run keeps their rows up to its checkpoint and appends, rebuilding
    rows that were cut from them from ``trace.jsonl`` (the same values). Essential: an error
    writing them (a full disk) stops the run."""

    essential = True

    def start(self, info: RunInfo) -> None:
        self.metrics = self.evals = None
        at = info.start if info.resumed else None
        records: dict[int, dict[str, Any]] | None = None

        def traced() -> dict[int, dict[str, Any]]:
            nonlocal records
            if records is None:
                records = _trace_records(info.run_dir, at or 0)
            return records

        def metric_rows(steps: list[int]) -> dict[int, list[Any]]:
            t = traced()  # the values of its records are numbers or null (parse_trace_record)
            return {
                s: [s, *(t[s][k] for k in METRICS_FIELDS[1:])]
                for s in steps
                if all(t.get(s, {}).get(k) is not None for k in METRICS_FIELDS[1:])
            }

        def eval_rows(steps: list[int]) -> dict[int, list[Any]]:
            t = traced()
            return {
                s: [s, *(t[s]["eval"][m] for m in info.metric_names)]
                for s in steps
                if set(info.metric_names) <= set(t.get(s, {}).get("eval") or {})
            }

        trainer = info.config.get("trainer") or {}
        every, last = int(trainer.get("eval_every") or 0), int(trainer.get("max_steps") or 0)
        evaluated = [s for s in range(1, (at or 0) + 1) if s == last or (every and s % every == 0)]
        self.metrics = CsvLog(
            info.run_dir / METRICS_FILE,
            METRICS_FIELDS,
            at,
            list(range(1, (at or 0) + 1)),
            metric_rows,
        )
        self.evals = CsvLog(
            info.run_dir / EVAL_FILE, ["step", *info.metric_names], at, evaluated, eval_rows
        )

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        self.metrics.write([[r[k] for k in METRICS_FIELDS] for r in rows])

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.evals.write([[step, *metrics.values()]])

    def close(self) -> None:
        for log_file in (getattr(self, "metrics", None), getattr(self, "evals", None)):
            if log_file is not None:  # a start that failed leaves none
                log_file.close()


def _final_metrics(summary: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """The test metrics of ``trainer.test`` (step: the tested checkpoint's), if any."""
    test = summary.get("test") or {}
    return int(test.get("step") or summary["steps"]), dict(test.get("metrics") or {})


class TensorBoardLogger(Logger):
    """Event files under ``<run dir>/<subdir>`` (``tensorboard --logdir outputs``): a
    scalar per value (the CSV's names), and the metadata files and summary as text. A
    resumed run discards what the killed process wrote past its checkpoint (``purge_step``)
    and writes those steps again, with the same values."""

    requires = ("tensorboard", "tensorboard")

    def __init__(self, subdir: str = "tensorboard", flush_secs: int = 30) -> None:
        self.subdir, self.flush_secs = subdir, flush_secs

    def start(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run (or one started again from step 0) rewrites the steps after its start
        again = info.resumed or (info.run_dir / self.subdir).is_dir()
        purge = info.start + 1 if again else None
        self.writer = SummaryWriter(
            str(info.run_dir / self.subdir), purge_step=purge, flush_secs=self.flush_secs
        )
        step = info.start
        self.writer.add_text("config", _code(json.dumps(info.config, indent=2)), step)
        for path in info.metadata:
            self.writer.add_text(path.name, _code(path.read_text()), step)

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            for key in ("loss", "grad_norm", "lr"):
                self.writer.add_scalar(key, r[key], r["step"])

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        step, test = _final_metrics(summary)
        for key, value in test.items():
            self.writer.add_scalar(key, value, step)
        text = json.dumps(finite_or_null(summary), indent=2, default=str)
        self.writer.add_text("summary.json", _code(text), int(summary["steps"]))

    def close(self) -> None:
        if hasattr(self, "writer"):
            self.writer.close()


def _code(text: str) -> str:
    """Text as a markdown code block (TensorBoard's text tab renders markdown)."""
    return "\n".join("    " + line for line in text.splitlines())


class MlflowLogger(Logger):
    """One MLflow run per run directory, in ``tracking_uri`` (default: a SQLite store
    beside the runs, ``mlflow ui --backend-store-uri sqlite:///outputs/mlflow.db``; or a
    tracking server's URL). Params: the flattened config; artifacts: the config, the
    metadata files and ``summary.json``; tags: the run directory, the weights' digest. A
    resumed run continues the same MLflow run (its id is in ``loggers.json``); the steps
    the killed process logged past its checkpoint are logged again with the same values."""

    requires = ("mlflow", "mlflow")

    def __init__(
        self,
        tracking_uri: str,
        experiment: str = "repro",
        run_name: str | None = None,
        artifact_location: str | None = None,
    ) -> None:
        self.uri = _absolute_sqlite(tracking_uri)
        if self.uri.startswith("sqlite:") and any(
            importlib.util.find_spec(m) is None for m in ("sqlalchemy", "alembic")
        ):
            raise MissingPackage(
                "config error: logger=mlflow with a SQLite store needs sqlalchemy and alembic: "
                "pip install -e '.[mlflow]' (or a tracking server: logger.mlflow.tracking_uri=http://...).",
                "sqlalchemy",
            )
        self.experiment, self.run_name = experiment, run_name
        self.artifact_location = artifact_location
        self.run_id: str | None = None
        self.finished = False

    def start(self, info: RunInfo) -> None:
        from mlflow.tracking import MlflowClient

        for noisy in ("mlflow", "alembic"):  # "Creating initial MLflow database tables..."
            logging.getLogger(noisy).setLevel(logging.WARNING)
        if self.uri.startswith("sqlite:///"):
            Path(self.uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        # this directory's MLflow run, also when it starts again from step 0 (killed
        # before its first checkpoint): continued, not left RUNNING beside a second one
        held = remembered(info.run_dir, "mlflow")
        if held and held.get("tracking_uri") == self.uri and continues(held, info):
            self.run_id = held["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            if held and held.get("tracking_uri") == self.uri:  # an earlier attempt's config
                try:
                    self.client.set_terminated(held["run_id"], "KILLED")
                except Exception:  # the store was reset, the run deleted: nothing to mark
                    pass
            experiment = self.client.get_experiment_by_name(self.experiment)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                location = self.artifact_location or _beside_store(self.uri)
                experiment_id = self.client.create_experiment(self.experiment, location)
            run = self.client.create_run(
                experiment_id,
                run_name=self.run_name or info.run_dir.name,
                tags={"repro.run_dir": str(info.run_dir.resolve())},
            )
            self.run_id = run.info.run_id
            remember(
                info.run_dir,
                "mlflow",
                {"tracking_uri": self.uri, "run_id": self.run_id, "config": fingerprint(info)},
            )
            self._log_params(info.config)
            self.client.log_dict(self.run_id, info.config, "config.json")
        for path in info.metadata:
            self.client.log_artifact(self.run_id, str(path))

    def _log_params(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in _params(config).items()]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def _log(self, records: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, s) for s, values in records for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        self._log([(r["step"], {k: r[k] for k in ("loss", "grad_norm", "lr")}) for r in rows])

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._log([(step, metrics)])

    def finish(self, summary: dict[str, Any]) -> None:
        step, test = _final_metrics(summary)
        if test:
            self._log([(step, test)])
        self.client.set_tag(self.run_id, "weights_sha256", summary["weights_sha256"])
        self.client.log_dict(self.run_id, finite_or_null(summary), "summary.json")
        self.client.set_terminated(self.run_id, "FINISHED")
        self.finished = True

    def close(self) -> None:
        if self.run_id is not None and not self.finished:  # stopped early: resumable
            self.client.set_terminated(self.run_id, "KILLED")


def _params(config: dict[str, Any]) -> dict[str, str]:
    """The config as MLflow params (dotted keys, values as text of at most 6000 chars)."""
    return {k: str(v)[:6000] for k, v in flatten(config).items()}


def _absolute_sqlite(uri: str) -> str:
    """``sqlite:///relative/path.db`` made absolute (from the directory train.py started
    in): the store is the same wherever a process runs."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri.startswith(prefix + "/"):
        return uri
    return prefix + str(Path(uri[len(prefix) :]).resolve())


def _beside_store(uri: str) -> str | None:
    """Artifacts of a SQLite store in ``mlflow-artifacts/`` beside its file (MLflow's own
    default is ``./mlruns`` of whatever directory the process runs in)."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///") :]).parent / "mlflow-artifacts")
    return None


WANDB_MODES = ("offline", "online", "disabled")


class WandbLogger(Logger):
    """A Weights & Biases run, offline by default (``wandb sync <run dir>/wandb/offline-*``
    uploads it later; ``mode=online`` logs in directly). Config: the resolved config, and
    the determinism report and ``env.json`` under ``repro_metadata``; summary:
    ``summary.json``'s values. A resumed run continues the
    same W&B run (its id is in ``loggers.json``); W&B drops the steps logged again after a
    resume (it warns), whose values are the same."""

    requires = ("wandb", "wandb")

    def __init__(
        self,
        project: str = "repro",
        mode: str = "offline",
        entity: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
    ) -> None:
        if mode not in WANDB_MODES:
            raise ConfigError(
                f"config error: logger.wandb.mode={mode!r} is invalid; allowed: "
                f"{', '.join(WANDB_MODES)}."
            )
        self.project, self.mode, self.entity, self.name, self.tags = (
            project,
            mode,
            entity,
            name,
            tags,
        )
        self.run: Any = None

    def start(self, info: RunInfo) -> None:
        import wandb

        held = remembered(info.run_dir, "wandb")  # also when started again from step 0
        same = held is not None and "id" in held and continues(held, info)
        run_id = held["id"] if same else uuid.uuid4().hex[:12]  # os.urandom: no RNG touched
        remember(info.run_dir, "wandb", {"id": run_id, "config": fingerprint(info)})
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.name or info.run_dir.name,
            tags=self.tags,
            id=run_id,
            resume="allow",
            mode=self.mode,
            dir=str(info.run_dir),
            config=info.config,
            settings=wandb.Settings(console="off", quiet=True),
        )
        metadata = {p.name: json.loads(p.read_text()) for p in info.metadata if p.suffix == ".json"}
        self.run.config.update({"repro_metadata": metadata}, allow_val_change=True)

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.run.log({k: r[k] for k in ("loss", "grad_norm", "lr")}, step=r["step"])

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        _, test = _final_metrics(summary)
        values = {k: v for k, v in finite_or_null(summary).items() if not isinstance(v, dict)}
        self.run.summary.update({**values, **test})
        self.run.finish()
        self.run = None

    def close(self) -> None:
        if self.run is not None:  # stopped early
            self.run.finish(exit_code=1)
            self.run = None
