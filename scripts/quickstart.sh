#!/usr/bin/env bash
# Quickstart command 1: install, train k3-tiny on Shakespeare (CPU, about 10 minutes), then sample.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch's OpenMP threads spin while they wait: fastest on idle cores, about 2x slower when another job keeps a
# core busy, where sleeping threads win (benchmarks/results/cpu_threads.md). Sleep when the machine is busy.
if [ -z "${OMP_WAIT_POLICY:-}" ] && awk '{ exit !($1 >= 1.0) }' /proc/loadavg 2>/dev/null; then
  export OMP_WAIT_POLICY=PASSIVE
fi
bash scripts/install.sh
openk3 train "$@"
echo "--- sample: openk3 generate --ckpt runs/k3-tiny ---"
openk3 generate --ckpt runs/k3-tiny --prompt "KING HENRY:" --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 0
