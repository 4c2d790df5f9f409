#!/usr/bin/env bash
# GPU readiness check (under 5 minutes on one GPU): profile a model on CUDA, train it with 1F1B and BPipe, and
# print the profile's prediction against the measurement (bench_predict.py's table).
#
#   benchmarks/gpu_check.sh                 # CUDA: gpt-mini in bfloat16, sizes 1,2,4,8
#   benchmarks/gpu_check.sh --device cpu    # dry run of the same steps on CPU with gpt-tiny (tested in make test)
#
# Pipeline ranks need one GPU each (NCCL refuses two ranks on one device): with two or more GPUs it trains P=2
# with 1f1b and bpipe; with one GPU it trains P=1 (1f1b only, un-pipelined: compute, optimizer and memory are still
# predicted against measured) and says that BPipe needs a second GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEVICE=cuda
OUT=${OUT:-gpu_check_out}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown option $1 (use --device cuda|cpu, --out DIR)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
start=$(date +%s)
if [ "$DEVICE" = cuda ]; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
  if [ "$NGPU" -lt 1 ]; then echo "gpu_check.sh: no CUDA GPU visible (use --device cpu for the dry run)" >&2; exit 2; fi
  # float32: `evenpipe train` runs in float32, and a profile must match the training dtype
  MODEL=gpt-mini; DTYPE=float32; PSIZES=1,2,4,8; SIZES=4; UNPROF=6; STEPS=12; REPEATS=10; M=8
else
  NGPU=2  # CPU dry run: two processes
  MODEL=gpt-tiny; DTYPE=float32; PSIZES=1,2; SIZES=2; UNPROF=; STEPS=2; REPEATS=1; M=4
fi
if [ "$NGPU" -ge 2 ]; then P=2; SCHEDULES=1f1b,bpipe; else P=1; SCHEDULES=1f1b
  echo "one GPU: training P=1 (1f1b); BPipe needs two pipeline ranks, so two GPUs"; fi
echo "== profile $MODEL on $DEVICE ($DTYPE), then train P=$P M=$M with $SCHEDULES"
$PY benchmarks/bench_predict.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --profile-sizes "$PSIZES" \
  --sizes "$SIZES" --unprofiled "$UNPROF" --schedules "$SCHEDULES" --stages "$P" --microbatches "$M" \
  --steps "$STEPS" --repeats "$REPEATS" --out "$OUT" --no-host-probe
echo "gpu_check.sh took $(( $(date +%s) - start )) s"
