#!/usr/bin/env bash
# Quickstart command 2: install with the test extras and run the tests on the CPU.
#   bash scripts/test.sh            the default run: every test not marked slow
#   bash scripts/test.sh --full     every test, slow ones included (what CI runs: CI=true selects it too)
# Further arguments go to pytest, e.g. bash scripts/test.sh tests/test_model.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenMP threads sleep instead of spinning while they wait: a shared CI machine cannot thrash the suite
# (spinning threads were ~2x slower per step with one core busy, benchmarks/results/cpu_threads.md).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
select=(-m "not slow")
if [ "${1:-}" = "--full" ]; then
  select=()
  shift
elif [ "${CI:-}" = "true" ]; then
  select=()
fi
bash scripts/install.sh test
# The sandbox tests boot microVMs: QEMU and the guest image tools come from Debian (only where apt-get runs as
# root; elsewhere those tests skip and say why). The guest image is built once and cached in ~/.cache/openk3.
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  for tool in qemu-system-x86_64 qemu-img mmdebstrap busybox cpio lz4; do
    if ! command -v "$tool" >/dev/null; then
      { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
          qemu-system-x86 qemu-utils mmdebstrap busybox-static cpio lz4 e2fsprogs; } >/dev/null \
        || echo "test.sh: apt-get install of the sandbox tools failed; the sandbox VM tests will skip"
      break
    fi
  done
fi
# Without a CUDA GPU, the Triton kernels run in Triton's CPU interpreter (needs triton >= 3.9); a CUDA machine
# keeps the triton that its torch build ships with.
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  python3 -m pip install -q "triton>=3.9"
fi
python3 -m pytest -q ${select[@]+"${select[@]}"} "$@"
