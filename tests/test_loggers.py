"""The logger group (conf/logger/): TensorBoard, MLflow and W&B receive the CSVs' values and
the run's metadata, continue across a resume, and leave the bits as they are."""

import csv
import importlib.util
import json
import struct

import numpy as np
import pytest

from conftest import CONF_DIR, SMALL_DATA, train_here
from optional import usable
from repro.base.errors import ConfigError
from repro.defense.config import LOGGER_BASE, check_overrides, compose
from repro.records.loggers import Logger

LOGGED = [
    "trainer.max_steps=8",
    "trainer.eval_every=4",
    "trainer.checkpoint_every=3",
    "trainer.log_every=2",
    "optim.clip_grad_norm=1.0",
    *SMALL_DATA,
    "model.width=8",
]
# tensorboard and mlflow are dev extras, wandb is not: each part runs where its package is
# installed and importable (a GPU image without the dev extras skips them, saying so)
HAS_WANDB = usable("wandb") is None
HAS_TENSORBOARD = usable("tensorboard") is None
HAS_MLFLOW = usable("mlflow") is None
CHOSEN = ["csv", *(name for name, has in (("tensorboard", HAS_TENSORBOARD), ("mlflow", HAS_MLFLOW),
                                          ("wandb", HAS_WANDB)) if has)]  # fmt: skip
needs_mlflow = pytest.mark.skipif(not HAS_MLFLOW, reason="needs mlflow (pip install -e '.[dev]')")
needs_tensorboard = pytest.mark.skipif(
    not HAS_TENSORBOARD, reason="needs tensorboard (pip install -e '.[dev]')"
)
KILLED_AT = 5  # after the checkpoint of step 3 and the evaluation (and flush) of step 4


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The same config trained with the csv logger only, and with every logger, killed after
    step 5 and resumed from its step-3 checkpoint (the loggers had steps 1-4 by then)."""
    base = tmp_path_factory.mktemp("loggers")
    plain = train_here(base / "plain", *LOGGED)
    store = base / "mlflow.db"
    overrides = [
        *LOGGED,
        f"logger=[{','.join(CHOSEN)}]",
        *([f"logger.mlflow.tracking_uri=sqlite:///{store}"] if HAS_MLFLOW else []),
    ]

    def kill(step, model):
        if step == KILLED_AT:
            raise Killed

    with pytest.raises(Killed):
        train_here(base / "run", *overrides, after_step=kill)
    ids = base / "run" / "loggers.json"  # written by the loggers that keep a run id (mlflow, wandb)
    first_ids = json.loads(ids.read_text()) if HAS_MLFLOW or HAS_WANDB else {}
    run = train_here(base / "run", *overrides, "trainer.resume=auto")
    return plain, run, first_ids, store


def csv_column(path, column):
    with open(path) as f:
        return {int(r["step"]): float(r[column]) for r in csv.DictReader(f)}


def test_the_loggers_leave_the_bits_as_they_are(logged):
    plain, run, _, _ = logged
    assert run.summary["resumes"] and not plain.summary["resumes"]
    assert run.summary["weights_sha256"] == plain.summary["weights_sha256"]
    for name in ("metrics.csv", "eval.csv"):  # the csv logger: as without the others
        assert (run.dir / name).read_text() == (plain.dir / name).read_text()


@needs_tensorboard
def test_tensorboard_holds_every_step_once_after_the_resume(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run, _, _ = logged
    events = EventAccumulator(str(run.dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    loss = csv_column(run.dir / "metrics.csv", "loss")
    # the killed process's step 4, past its checkpoint, was purged and written again
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (s, float(np.float32(v))) for s, v in sorted(loss.items())
    ]
    accuracy = csv_column(run.dir / "eval.csv", "val_accuracy")
    assert [(e.step, e.value) for e in events.Scalars("val_accuracy")] == [
        (s, float(np.float32(v))) for s, v in sorted(accuracy.items())
    ]
    texts = set(events.Tags()["tensors"])
    for name in ("config", "determinism.json", "env.json", "env-resume-3.json", "summary.json"):
        assert f"{name}/text_summary" in texts


@needs_mlflow
def test_mlflow_continues_one_run_with_the_exact_values(logged):
    from mlflow.tracking import MlflowClient

    _, run, first_ids, store = logged
    ids = json.loads((run.dir / "loggers.json").read_text())
    assert ids["mlflow"] == first_ids["mlflow"]  # the resume continued the same MLflow run
    client = MlflowClient(f"sqlite:///{store}")
    run_id = ids["mlflow"]["run_id"]
    (experiment,) = [e for e in client.search_experiments() if e.name == "repro"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    logged_run = client.get_run(run_id)
    assert logged_run.info.status == "FINISHED"
    assert logged_run.data.tags["weights_sha256"] == run.summary["weights_sha256"]
    assert logged_run.data.params["seed"] == "0"
    assert logged_run.data.params["optim.clip_grad_norm"] == "1.0"
    for column in ("loss", "grad_norm", "lr"):
        expected = csv_column(run.dir / "metrics.csv", column)
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, column)]
        # step 4 came twice (flushed at its evaluation before the kill, and after the
        # resume from step 3): with the same value
        assert sorted(s for s, _ in history) == [1, 2, 3, 4, 4, 5, 6, 7, 8]
        assert all(v == expected[s] for s, v in history), column  # float64: exact
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.json", "determinism.json", "env.json", "env-resume-3.json"} <= artifacts
    assert "summary.json" in artifacts


def wandb_history(run_dir):
    """Every history row of the run's offline W&B files, read back with W&B's record format
    (32 KiB blocks of chunks: CRC32, length, type; protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        raw, pos, part = path.read_bytes(), 7, b""  # after the 7-byte file header
        while pos + 7 <= len(raw):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
            if left < 7 or (length == 0 and kind == 0):  # the block's padding
                pos += left
                continue
            part += raw[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or a record's last chunk
                record = wandb_internal_pb2.Record()
                record.ParseFromString(part)
                part = b""
                if record.WhichOneof("record_type") == "history":
                    items = record.history.item
                    rows.append(
                        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                    )
    return rows


@pytest.mark.skipif(not HAS_WANDB, reason="needs wandb (pip install -e '.[wandb]')")
def test_wandb_offline_holds_the_exact_values(logged):
    _, run, first_ids, _ = logged
    assert json.loads((run.dir / "loggers.json").read_text())["wandb"] == first_ids["wandb"]
    loss = csv_column(run.dir / "metrics.csv", "loss")
    rows = [r for r in wandb_history(run.dir) if "loss" in r]
    assert {r["_step"] for r in rows} == set(loss)
    assert all(r["loss"] == loss[r["_step"]] for r in rows)


class Broken(Logger):
    """A logger whose tracking server goes away at the first evaluation."""

    def log_eval(self, step, metrics):
        raise ConnectionError("the tracking server went away")


def test_a_logger_that_fails_mid_run_is_dropped_and_the_run_goes_on(logged, tmp_path):
    plain = logged[0]
    run = train_here(tmp_path / "run", *LOGGED, f"+logger.broken._target_={__name__}.Broken")
    assert "logger broken failed (ConnectionError: the tracking server went away)" in run.output
    assert run.summary["weights_sha256"] == plain.summary["weights_sha256"]
    assert (run.dir / "eval.csv").read_text() == (plain.dir / "eval.csv").read_text()


def test_a_logger_without_its_package_is_one_line_with_the_pip_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        compose(["logger=[csv,mlflow]"])
    assert "logger=mlflow needs the mlflow package" in str(err.value)
    assert "pip install -e '.[mlflow]'" in str(err.value)


def test_a_loggers_bad_value_is_named_before_the_run(monkeypatch):
    with pytest.raises(ConfigError, match="logger.tensorboard.flush_every is not an argument"):
        compose(["logger=tensorboard", "+logger.tensorboard.flush_every=3"])
    with pytest.raises(ConfigError, match="logger=tensorbord is not an option"):
        check_overrides(["logger=[csv,tensorbord]"], CONF_DIR)
    real = importlib.util.find_spec  # wandb is not among the dev extras: as if installed
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: real("json") if name == "wandb" else real(name, *a),
    )
    with pytest.raises(ConfigError, match="logger.wandb.mode='onlin' is invalid"):
        compose(["logger=wandb", "logger.wandb.mode=onlin"])
    with pytest.raises(ConfigError, match="is not a subclass of repro.records.loggers.Logger"):
        compose(["+logger.mine._target_=repro.loggers.remember"])
    # the config layer names the base class instead of importing it (it sits below the records)
    assert LOGGER_BASE == f"{Logger.__module__}.{Logger.__qualname__}"


@needs_mlflow
def test_a_run_killed_before_its_first_checkpoint_continues_its_mlflow_run(tmp_path):
    """Killed after step 2, before the step-3 checkpoint: the relaunch (resume=auto) starts
    again from step 0 in the same directory and continues the same MLflow run (the config is
    the remembered one's), which ends finished: one run, not a second one beside the
    first attempt's."""
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlflow.db"
    args = [*LOGGED, "logger=[csv,mlflow]", f"logger.mlflow.tracking_uri=sqlite:///{store}"]

    def kill(step, model):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        train_here(tmp_path / "run", *args, after_step=kill)
    run = train_here(tmp_path / "run", *args, "trainer.resume=auto")
    client = MlflowClient(f"sqlite:///{store}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "repro"]
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"], [r.info for r in runs]
    run_id = json.loads((run.dir / "loggers.json").read_text())["mlflow"]["run_id"]
    assert runs[0].info.run_id == run_id


HUGE = "1" + "0" * 400  # a JSON integer; float() of it raises OverflowError
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError


def test_a_resume_over_a_damaged_trace_names_the_file_and_rebuilds_nothing_from_it(
    tmp_path, caplog
):
    """On resume, metrics.csv's missing rows are rebuilt from trace.jsonl: from a line that
    is not a record (a loss no float holds, nesting too deep to parse, a loss that is text)
    nothing is, and a warning names the file, the line and the step before it; the trace is
    kept up to that step; a loggers.json so damaged is as none."""
    from repro.records.loggers import CsvLogger, RunInfo, remember, remembered
    from repro.records.logs import keep_trace_prefix

    row = {"epoch": 0, "grad_norm": 1.0, "lr": 0.1}
    good = [json.dumps({"step": s, "loss": 0.5, **row}) for s in range(5)]
    for n, bad in enumerate(
        (
            '{"step": 3, "epoch": 0, "loss": ' + HUGE + ', "grad_norm": 1.0, "lr": 0.1}',
            DEEP,
            '{"step": 3, "epoch": 0, "loss": "0.5", "grad_norm": 1.0, "lr": 0.1}',
        )
    ):
        run = tmp_path / str(n)
        run.mkdir()
        (run / "trace.jsonl").write_text("".join(x + "\n" for x in [*good[:3], bad, good[4]]))
        (run / "loggers.json").write_text(bad)
        caplog.clear()
        logger = CsvLogger()
        logger.start(RunInfo(run, {"trainer": {"max_steps": 8}}, [], ["val_accuracy"], 4, True))
        logger.close()
        with open(run / "metrics.csv") as f:
            assert [r["step"] for r in csv.DictReader(f)] == ["1", "2"], bad[:60]
        warned = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert f"{run / 'trace.jsonl'}:4 (after step 2): not a trace record (" in warned
        assert "metrics.csv: steps 3-4 are missing" in warned
        caplog.clear()
        assert keep_trace_prefix(run / "trace.jsonl", 4) == 2
        assert f"{run / 'trace.jsonl'}:4: not a trace record (" in caplog.text
        assert (run / "trace.jsonl").read_text() == "".join(x + "\n" for x in good[:3])
        assert remembered(run, "mlflow") is None
        remember(run, "mlflow", {"run_id": "x"})
        assert remembered(run, "mlflow") == {"run_id": "x"}
