#!/bin/sh
# Issue 35's measured points in one go on a quiet host with 2 cores (one training process per core), in under
# 8 minutes; each part has its own time limit and a failed part does not stop the others.
#
#   benchmarks/uneven_quiet.sh OUT_DIR            # the measurement
#   benchmarks/uneven_quiet.sh OUT_DIR --quick    # a short check that it runs (numbers noisy)
#
# 1. bench_uneven at P=2: benchmarks/data/deep_llama_config.json (32 blocks of hidden 128, 64 tokens), M=4, b=2
#    (about a quarter of a second a step on this host); rank 1 emulated 1.5x slower from step 10, 200 baseline
#    steps for false alarms, a 5 ms delay on link 0-1. At P=2 a re-planned layout recovers at most 60% (56% in
#    whole blocks, 19+13): the JSON's predicted_recovery is what to compare the measured recovery with (notes).
# 2. bench_latency_measured at P=2: gpt-tiny, every message one stage forward late, 3 rounds (M=16, the M the
#    simulator gives the largest gain at P=2).
# 3. bench_latency_measured at P=4 (M=4) when under 4.5 minutes have gone: 4 processes on 2 cores, so its
#    JSON says its timings are distorted.
# Outputs in OUT_DIR: uneven_p2.json, latency_p2.json, latency_p4.json (each with P, the host's cores and load
# before and after), the printed lines in *.txt, and times.txt (each part's seconds and exit status).
set -u
out=${1:?usage: benchmarks/uneven_quiet.sh OUT_DIR [--quick]}
quick=${2:-}
case "$quick" in ""|--quick) ;; *) echo "second argument must be --quick, got $quick" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=src OMP_NUM_THREADS=1
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out" || exit 2
t0=$(date +%s)
{ date -u; uptime; echo "cores $(getconf _NPROCESSORS_ONLN)"; } > "$out/times.txt"

part() {  # part NAME LIMIT_S COMMAND...: run it with a time limit, log its seconds and status
    name=$1 limit=$2
    shift 2
    s=$(date +%s)
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    rc=$?
    echo "$name: $(( $(date +%s) - s )) s, exit $rc, load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out/times.txt"
    tail -n 8 "$out/$name.txt"
}

part uneven_p2 300 "$py" benchmarks/bench_uneven.py --stages 2 --hf-config benchmarks/data/deep_llama_config.json \
    --microbatches 4 --microbatch-size 2 --profile-sizes 2 --slow-rank 1 --factor 1.5 $quick \
    --out "$out/uneven_p2" --json-out "$out/uneven_p2.json"
part latency_p2 150 "$py" benchmarks/bench_latency_measured.py --stages 2 --latency 1 --repeats 3 $quick \
    --out "$out/latency_p2" --json-out "$out/latency_p2.json"
if [ $(( $(date +%s) - t0 )) -lt 270 ]; then
    part latency_p4 $(( 470 - ($(date +%s) - t0) )) "$py" benchmarks/bench_latency_measured.py --stages 4 \
        --latency 1 --repeats 3 $quick --out "$out/latency_p4" --json-out "$out/latency_p4.json"
else
    echo "latency_p4: skipped ($(( $(date +%s) - t0 )) s gone)" | tee -a "$out/times.txt"
fi
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
