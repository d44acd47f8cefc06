#!/usr/bin/env bash
# The forker's path, from a fresh clone: clone this checkout (its last commit) into a
# temporary folder, `repro new NAME`, train the new experiment at its generated size, then
# `make test` there: the template's tests and the generated tests/test_NAME.py.
#   bash scripts/fork_check.sh [NAME]        (default: mylab; about 10 min on 2 cores)
# Prints each step's wall time; stops at the first failure with its exit status.
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
name="${1:-mylab}"
work="$(mktemp -d)"
git clone -q "$src" "$work/fork"
cd "$work/fork"
step() {
  local start=$SECONDS
  echo "== $*"
  "$@"
  echo "== $((SECONDS - start)) s: $*"
}
step make install
step .venv/bin/repro new "$name"
step make train ARGS="experiment=$name hydra.run.dir=outputs/$name"
grep -q '"dirty": true' "outputs/$name/env.json" && echo "env.json: dirty (the new files are untracked)"
step make test
echo "fork check passed in $work/fork"
