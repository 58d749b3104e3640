#!/usr/bin/env bash
# Quickstart command 2: install with the test extras and run the whole test suite (CPU, under 15 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m pytest -q "$@"
