"""The names of what a run directory holds (docs/resume.md describes each), in one place and
without heavy imports, so that the tools that only read a run do not load torch; and how
its JSON files keep valid (:func:`finite_or_null`)."""

import math
from typing import Any

TRACE_FILE = "trace.jsonl"  # repro.trace
ENV_FILE = "env.json"  # repro.fingerprint
METRICS_FILE = "metrics.csv"  # repro.logs
EVAL_FILE = "eval.csv"  # repro.logs
SUMMARY_FILE = "summary.json"  # repro.loop
ERROR_FILE = "error.json"  # train.py, for a failed job of a sweep
CHECKPOINT_DIR = "checkpoints"  # repro.checkpoint
TEST_FILE = "test.json"  # repro.loop: trainer.test's result
# each sample's row of the latest evaluation (repro.evaluation.Evaluation.write_per_sample)
VAL_PER_SAMPLE_FILE = "val_per_image.csv"
TEST_PER_SAMPLE_FILE = "test_per_image.csv"  # trainer.test's (repro evaluate: beside its --out)
BEST_FILE = "best.pt"  # repro.checkpoint: the checkpoint of the best evaluation so far
LOGGERS_FILE = "loggers.json"  # repro.loggers: the ids that let a resume continue an MLflow/W&B run
LOCK_FILE = ".lock"  # repro.rundir: the run's owner, for its lifetime
LAUNCH_DIR = ".hydra"  # train.py: the config, Hydra's config and the overrides of the launch
LOG_FILE = "train.log"  # Hydra's job log (opened at its first line)


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
