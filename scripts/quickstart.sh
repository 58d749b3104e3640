#!/usr/bin/env bash
# Quickstart command 1: install, train k3-tiny on Shakespeare (CPU, about 10 minutes), then sample.
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenMP threads sleep instead of spinning while they wait: on a machine whose cores are shared with other
# jobs, spinning torch threads made a k3-tiny step several times slower (benchmarks/results/cpu_threads.md).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
bash scripts/install.sh
openk3 train "$@"
openk3 generate --ckpt runs/k3-tiny --prompt "KING HENRY:" --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 0
