#!/usr/bin/env bash
# The whole test suite on a GPU machine, its CUDA tests included, with the log kept:
# OUTDIR/make-test-gpu-<date>-<GPU>.log (default benchmarks/), headed by the date, the GPUs,
# the driver and the versions, then pytest's output with every skip's reason (-rs).
#
#   scripts/test_gpu.sh                 # what `make test-gpu` runs
#   scripts/test_gpu.sh --out /tmp/o -- -k resume
#
# The tests not marked cuda run on the CPU there as in CI (tests/conftest.py hides the GPU
# from them); those marked cuda use it. Without a GPU it stops (make test is the command).
# PY picks the interpreter (default: python3); XDIST the pytest-xdist options.
# Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
out=benchmarks
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "test_gpu.sh: unknown option '$1' (--out DIR, then -- and pytest's options)" >&2; exit 2 ;;
  esac
done
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "test_gpu.sh: torch sees no CUDA GPU here; on a machine without one, make test runs the suite." >&2
  exit 2
fi
mkdir -p "$out"
gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
log="$out/make-test-gpu-$(date +%F)-$gpu.log"
export PYTHONHASHSEED=0 CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_WAIT_POLICY=PASSIVE NCCL_NVLS_ENABLE=0
cmd=("$PY" -m pytest ${XDIST:--n 6 --dist loadfile} -rs "$@")
{
  echo "# make test-gpu: the whole suite on a GPU machine, $(date +%F)"
  "$PY" -c "import torch; n = torch.cuda.device_count(); print(f'# {n} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}')"
  echo "# driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1); $(nproc) CPU cores"
  echo "## ${cmd[*]}"
} > "$log"
"${cmd[@]}" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
echo "log: $log"
exit "$status"
