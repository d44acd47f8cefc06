#!/usr/bin/env bash
# Kill a run from outside (SIGKILL, mid-epoch, between two checkpoints), resume it with
# trainer.resume=auto, and compare with the uninterrupted run: the same weights digest.
#
#   bash scripts/resume_demo.sh            # about a minute on a 2-core CPU
#   STEPS=300 KILL_AT=137 bash scripts/resume_demo.sh -- amp=on   # extra train.py overrides
#
# Runs go to $DEMO_DIR/{straight,killed} (default outputs/resume-demo/<time>).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
STEPS=${STEPS:-60}
KILL_AT=${KILL_AT:-37}
EVERY=${EVERY:-10}
[ "${1:-}" = "--" ] && shift
DEMO_DIR=${DEMO_DIR:-outputs/resume-demo/$(date +%Y-%m-%d_%H-%M-%S)}
ARGS=(trainer.max_steps="$STEPS" trainer.checkpoint_every="$EVERY" trainer.eval_every="$STEPS"
      trainer.log_every=1 loader=multi "$@")
export CI=true  # no progress bars

echo "1/3 uninterrupted run: $STEPS steps into $DEMO_DIR/straight"
"$PY" train.py hydra.run.dir="$DEMO_DIR/straight" "${ARGS[@]}" > /dev/null

echo "2/3 the same run, SIGKILLed after step $KILL_AT (checkpoints every $EVERY steps)"
"$PY" train.py hydra.run.dir="$DEMO_DIR/killed" "${ARGS[@]}" > /dev/null 2>&1 &
pid=$!
until [ -f "$DEMO_DIR/killed/metrics.csv" ] && [ "$(($(wc -l < "$DEMO_DIR/killed/metrics.csv") - 1))" -ge "$KILL_AT" ]; do
  kill -0 "$pid" 2>/dev/null || { echo "the run ended before step $KILL_AT" >&2; exit 1; }
  sleep 0.01
done
kill -KILL "$pid"
wait "$pid" 2>/dev/null || true
echo "    killed after step $(($(wc -l < "$DEMO_DIR/killed/metrics.csv") - 1)); checkpoints:" \
  "$(cd "$DEMO_DIR/killed/checkpoints" && ls step-*.pt | tr '\n' ' ')"

echo "3/3 resume it: trainer.resume=auto"
"$PY" train.py hydra.run.dir="$DEMO_DIR/killed" "${ARGS[@]}" trainer.resume=auto > /dev/null

digest() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['weights_sha256'])" "$1/summary.json"; }
a=$(digest "$DEMO_DIR/straight"); b=$(digest "$DEMO_DIR/killed")
echo
echo "uninterrupted        weights_sha256 $a"
echo "killed and resumed   weights_sha256 $b"
"$PY" -m repro compare "$DEMO_DIR/straight" "$DEMO_DIR/killed" | sed -n 1p  # reads it all: no SIGPIPE
[ "$a" = "$b" ] && echo "PASS: identical bits" || { echo "FAIL: the digests differ"; exit 1; }
