"""The names of what a run directory holds (docs/resume.md describes each), in one place and
without imports, so that the tools that only read a run do not load torch."""

TRACE_FILE = "trace.jsonl"  # repro.trace
ENV_FILE = "env.json"  # repro.fingerprint
METRICS_FILE = "metrics.csv"  # repro.logs
EVAL_FILE = "eval.csv"  # repro.logs
SUMMARY_FILE = "summary.json"  # repro.loop
ERROR_FILE = "error.json"  # train.py, for a failed job of a sweep
CHECKPOINT_DIR = "checkpoints"  # repro.checkpoint
