#!/usr/bin/env bash
# One command for a GPU machine: the CUDA-marked tests, the drift demonstration, the
# throughput benchmark and, with 2 or more GPUs, the multi-GPU checks; every log and result
# goes into OUTDIR (default benchmarks/), ready to commit.
#
#   scripts/gpu_check.sh                      # everything
#   scripts/gpu_check.sh --out /tmp/o tests dist
#
# Parts: tests (pytest -m 'cuda or lightning'), drift (scripts/drift_demo.py), bench
# (scripts/benchmark.py, --lightning where Lightning is installed),
# dist (scripts/dist_benchmark.py --ddp on 1, 2 [, 4] GPUs: the reduce-scatter overlapped
# with the backward pass and after it, the older all-gather path (the same bits) and plain
# DDP: ResNet-18 preset at batch 256, bf16, then the default ConvNet at batch 128; 6 loader
# workers a rank; dist-resnet18 or dist-convnet alone: one model, 18 runs on 2 GPUs, an
# estimated 8 min).
# PY picks the interpreter (default: python3).
# Exit status: 1 if any part failed (the others still run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
out=benchmarks
parts=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    tests|drift|bench|dist|dist-resnet18|dist-convnet) parts+=("$1"); shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown part '$1' (tests, drift, bench, dist[-resnet18|-convnet], --out DIR)" >&2; exit 2 ;;
  esac
done
[ ${#parts[@]} -eq 0 ] && parts=(tests drift bench dist)
if ! command -v nvidia-smi >/dev/null || ! ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); then
  echo "gpu_check.sh: no NVIDIA GPU here (nvidia-smi); run it on the GPU machine." >&2
  exit 2
fi
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on shared hosts
mkdir -p "$out"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr ' ' _)
log="$out/gpu-check-$(date +%F)-$gpu.log"
failed=()

run_part() {  # name, command...
  local name=$1; shift
  echo "== $name: $*  ($(date -u +%FT%TZ))"
  local t0=$SECONDS
  if "$@"; then echo "== $name: ok ($((SECONDS - t0)) s)"; else
    echo "== $name: FAILED ($((SECONDS - t0)) s)"; failed+=("$name"); fi
}

{
  echo "gpu_check.sh on $(hostname): $ngpu x $gpu; $("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())')"
  for part in "${parts[@]}"; do
    case $part in
      tests) run_part tests "$PY" -m pytest -m "cuda or lightning" -q -rs -p no:cacheprovider ;;
      drift) run_part drift "$PY" scripts/drift_demo.py --out "$out" ;;
      bench)  # with the Lightning peer row where Lightning is installed (the GPU image has it)
        peer=(); "$PY" -c "import lightning" 2>/dev/null && peer=(--lightning)
        run_part bench "$PY" scripts/benchmark.py --out "$out" "${peer[@]}" ;;
      dist|dist-resnet18|dist-convnet)
        if [ "$ngpu" -lt 2 ]; then echo "== $part: skipped (1 GPU)"; continue; fi
        sizes="1 2"; [ "$ngpu" -ge 4 ] && sizes="1 2 4"
        reductions="ordered ordered_no_overlap ordered_allgather"
        if [ "$part" != dist-convnet ]; then
          # shellcheck disable=SC2086
          run_part dist-resnet18 "$PY" scripts/dist_benchmark.py --ddp --world-sizes $sizes \
            --reductions $reductions --steps 200 --label resnet18 --out "$out" -- device=cuda \
            model=resnet18 trainer.batch_size=256 trainer.micro_batch_size=64 amp=on loader=multi \
            loader.num_workers=6
        fi
        if [ "$part" != dist-resnet18 ]; then
          # shellcheck disable=SC2086
          run_part dist-convnet "$PY" scripts/dist_benchmark.py --ddp --world-sizes $sizes \
            --reductions $reductions --steps 200 --label convnet --out "$out" -- device=cuda \
            trainer.batch_size=128 trainer.micro_batch_size=32 amp=on loader=multi loader.num_workers=6
        fi
        ;;
    esac
  done
  if [ ${#failed[@]} -gt 0 ]; then echo "gpu_check.sh: FAILED: ${failed[*]}"; else echo "gpu_check.sh: all ok"; fi
} 2>&1 | tee "$log"
echo "log: $log"
grep -q "gpu_check.sh: all ok" "$log"
