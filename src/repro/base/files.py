"""The names of what a run directory holds (docs/resume.md describes each), in one place and
without heavy imports, so that the tools that only read a run do not load torch; how its
JSON files keep valid (:func:`finite_or_null`) and are read back (:func:`parse_json`); how
its files are opened to append, never through a link (:func:`open_run_file`); and how its
directory is named on a command line (:func:`resume_command`)."""

import errno
import io
import json
import math
import os
import re
import shlex
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, BinaryIO

from repro.base.errors import ConfigError, ReproError

# this package (src/repro) and the folder holding its src/: an editable install's checkout
PACKAGE_DIR = Path(__file__).resolve().parents[1]
CHECKOUT_DIR = PACKAGE_DIR.parents[1]

TRACE_FILE = "trace.jsonl"  # repro.records.trace
ENV_FILE = "env.json"  # repro.records.fingerprint
METRICS_FILE = "metrics.csv"  # repro.records.logs
EVAL_FILE = "eval.csv"  # repro.records.logs
SUMMARY_FILE = "summary.json"  # repro.engine.loop
ERROR_FILE = "error.json"  # train.py, for a failed job of a sweep
CHECKPOINT_DIR = "checkpoints"  # repro.records.checkpoint
TEST_FILE = "test.json"  # repro.engine.loop: trainer.test's result
# each sample's row of the latest evaluation (repro.engine.evaluation.Evaluation.write_per_sample)
VAL_PER_SAMPLE_FILE = "val_per_image.csv"
TEST_PER_SAMPLE_FILE = "test_per_image.csv"  # trainer.test's (repro evaluate: beside its --out)
BEST_FILE = "best.pt"  # repro.records.checkpoint: the checkpoint of the best evaluation so far
LOGGERS_FILE = (
    "loggers.json"  # repro.records.loggers: the ids that let a resume continue an MLflow/W&B run
)
LOCK_FILE = ".lock"  # repro.records.rundir: the run's owner, for its lifetime
LAUNCH_DIR = ".hydra"  # train.py: the config, Hydra's config and the overrides of the launch
OVERRIDES_FILE = f"{LAUNCH_DIR}/overrides.yaml"  # what the launch overrode (trust.py)
LOG_FILE = "train.log"  # Hydra's job log (opened at its first line)
# What only a run of this project leaves: a directory holding one of these is a run.
RUN_MARKERS = (LAUNCH_DIR, "determinism.json", ENV_FILE, TRACE_FILE, CHECKPOINT_DIR, SUMMARY_FILE)
# The names of the run's own records: a file a config names in the run directory
# (trainer.checkpoint_name, a logger's folder) is none of them, nor under one of them
RUN_RECORDS = (
    *RUN_MARKERS,
    "determinism.txt",
    METRICS_FILE,
    EVAL_FILE,
    ERROR_FILE,
    TEST_FILE,
    VAL_PER_SAMPLE_FILE,
    TEST_PER_SAMPLE_FILE,
    BEST_FILE,
    LOGGERS_FILE,
    LOCK_FILE,
    LOG_FILE,
)


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every float that is not finite (a diverged loss, the Dice of a class that
    never occurs) replaced by ``None``: JSON's null, where a bare NaN is not valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def _float_sized_int(text: str) -> int:
    """A JSON integer; one no float can hold (``float()`` of it raises OverflowError where
    the value is used, as a metric, a loss) is refused as damage: ValueError."""
    value = int(text)  # over 4300 digits: ValueError already
    if len(text) > 308:  # the largest float has 309 digits
        try:
            float(value)
        except OverflowError:
            digits = len(text.lstrip("-"))
            raise ValueError(f"an integer of {digits} digits, beyond a float's range") from None
    return value


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` for a file a run left behind, which damage (or a hand) may have filled
    with what this package never writes: an integer beyond a float's range and nesting too
    deep to parse (RecursionError) are ``ValueError`` here, like any other text that is not
    JSON, so that the reader's one ``except ValueError`` names the file. (``1e400`` is a
    float: infinity, as a diverged loss.)"""
    try:
        return json.loads(text, parse_int=_float_sized_int)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_trace_record(line: str) -> dict[str, Any]:
    """One line of ``trace.jsonl`` (:mod:`repro.records.trace`) as its record; ValueError, saying
    what is wrong, for a line that is not one: not JSON (:func:`parse_json`), not an object
    with an integer ``step``, or an entry not of the kind the trace writes and its readers
    (compare, a resume's rebuilt logs) take it for: a number, a digest, a mapping of them."""
    record = parse_json(line)
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError("not an object with an integer step")
    for key in ("epoch", "loss", "grad_norm", "lr"):
        if not (record.get(key) is None or _number(record[key])):
            raise ValueError(f"step {record['step']}'s {key} is {str(record[key])[:40]!r}")
    for key in ("eval", "tensors", "batch", "task"):
        if not isinstance(record.get(key) or {}, dict):
            raise ValueError(f"step {record['step']}'s {key} is not a JSON object")
    for key, value in (record.get("eval") or {}).items():
        if not _number(value):
            raise ValueError(f"step {record['step']}'s {key} is {str(value)[:40]!r}")
    for key in ("inputs", "labels"):
        if not isinstance((record.get("batch") or {}).get(key, ""), str):
            raise ValueError(f"step {record['step']}'s batch {key} is not a digest")
    return record


def link_refused(path: str | Path) -> ConfigError:
    """The one line for a run's file found to be a symbolic link (never written through)."""
    return ConfigError(
        f"{path} is a symbolic link; a run's files are never written through links: remove it."
    )


def atomic_write(
    path: Path,
    write: Callable[[BinaryIO], Any],
    before_replace: Callable[[], Any] | None = None,
) -> None:
    """Write through a temporary file in the same folder, fsync it, then rename over ``path``
    (``before_replace``, if given, is called just before the rename).

    A crash at any moment leaves either the old file or the new one, never half of one. An
    error names ``path`` (a full disk met by ``write`` names no file of its own)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _naming(err, path) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise _naming(err, path) from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _naming(err: OSError, path: Path) -> OSError:
    """``err`` naming the file being written, not a temporary name or none at all."""
    return OSError(err.errno, err.strerror or str(err), str(path))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_file(path: Path, text: str) -> None:
    """``text`` into ``path`` whole, through a temporary file renamed into place: a link
    found at ``path`` is replaced by the file, what it leads to is left as it was."""
    atomic_write(path, lambda f: f.write(text.encode()))


def save_figure(fig: Any, path: Path) -> None:
    """A matplotlib figure as a PNG at ``path``, written as :func:`write_file` writes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write(path, lambda f: f.write(buffer.getvalue()))


def open_run_file(path: str | Path, mode: str = "a", **kwargs: Any) -> IO[Any]:
    """A run's file opened to append (``"a"``) or to write from empty (``"w"``), created if
    need be, never through a symbolic link (``O_NOFOLLOW``): one found at ``path`` is
    refused (:func:`link_refused`), what it leads to left as it was. ``kwargs``: those of
    :func:`open` (``newline``, ``encoding``)."""
    if mode.rstrip("bt") not in ("a", "w"):
        raise ValueError(f"open_run_file: mode {mode!r} (give 'a' or 'w')")
    append = os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | append, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise link_refused(path) from None
        raise
    return os.fdopen(fd, mode, **kwargs)


def hydra_quoted(value: str) -> str:
    """``value`` as a quoted value of Hydra's override grammar (``'...'``): a quote escaped,
    and the backslashes doubled where they precede a quote or the closing one (elsewhere a
    backslash is itself)."""
    escaped = re.sub(
        r"(\\*)('|\Z)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value
    )
    return f"'{escaped}'"


def shell_override(key: str, value: str) -> str:
    """``key=value`` as one word to paste into a shell, read back by Hydra as ``value``
    exactly: a path with ``=`` in it (the default ``..._seed=0_...``) Hydra-quoted, then the
    word quoted for the shell, as docs/resume.md writes it (``"key='value'"``)."""
    if not (re.fullmatch(r"[\w./-]+", value, re.ASCII) and "/" in value):  # else a plain path
        value = hydra_quoted(value)
    word = f"{key}={value}"
    if re.fullmatch(r"[\w./=-]+", word, re.ASCII):
        return word
    return f'"{word}"' if not re.search(r'[$`"\\!]', word) else shlex.quote(word)


def resume_command(run_dir: str | Path | None = None) -> str:
    """What to add to a run's command to resume it: ``trainer.resume=auto`` and its
    directory (``hydra.run.dir``), quoted to paste."""
    where = "" if run_dir is None else " " + shell_override("hydra.run.dir", str(run_dir))
    return "trainer.resume=auto" + where


def load_yaml(
    path: Path, remedy: str = "fix it, or move its job directory out of the sweep"
) -> Any:
    """A YAML file of a run directory as plain Python; one line naming it (and ``remedy``)
    if it is damaged."""
    from omegaconf import OmegaConf

    try:
        text = Path(path).read_bytes()
        problem = _yaml_out_of_bounds(text)
        if problem is None:
            return OmegaConf.to_container(OmegaConf.create(text.decode("utf-8")))
    except Exception as err:  # yaml's parser and scanner errors, undecodable bytes
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ReproError(
            f"{path}: not valid YAML ({first}); the file is damaged: {remedy}."
        ) from None
    raise ReproError(f"{path}: {problem}; not a record this project writes: {remedy}.")


# What a run's own YAML (its config, overrides, Hydra's settings: a few KiB, a few hundred
# values) stays far inside; a received file past them is refused before it is expanded
YAML_MAX_BYTES = 8 * 2**20
YAML_MAX_DEPTH = 64
YAML_MAX_VALUES = 200_000  # every value counted once per place an alias repeats it


def _yaml_out_of_bounds(text: bytes) -> str | None:
    """Why ``text`` is too large to read as a run's record, or None: its size, its nesting,
    or the number of values it expands to through anchors and aliases (a "billion laughs"
    of 9 levels of 10 aliases is 10^9 values in a few hundred bytes), counted from the
    parser's events without building anything."""
    import yaml

    if len(text) > YAML_MAX_BYTES:
        return f"{len(text):,} bytes, over {YAML_MAX_BYTES:,}"
    values = 0
    anchored: dict[str, int] = {}  # anchor -> how many values its node expands to
    open_nodes: list[tuple[str | None, int]] = []  # (anchor, values before it)
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            open_nodes.append((event.anchor, values))
            if len(open_nodes) > YAML_MAX_DEPTH:
                return f"nested over {YAML_MAX_DEPTH} levels deep"
            values += 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, before = open_nodes.pop()
            if anchor is not None:
                anchored[anchor] = values - before
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                anchored[event.anchor] = 1
            values += 1
        elif isinstance(event, yaml.AliasEvent):
            values += anchored.get(event.anchor, 1)
        if values > YAML_MAX_VALUES:
            return f"expands to over {YAML_MAX_VALUES:,} values (anchors and aliases)"
    return None
