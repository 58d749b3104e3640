#!/usr/bin/env bash
# The multi-GPU checks and measurements of openk3.dist on one N-GPU host (N = 2, 4 or 8), NCCL.
#   bash scripts/multi_gpu.sh N [STAGE ...]      stages: tests bench fla parity scaling (default: all five)
# Each stage runs under `timeout` (a hang costs its budget, not the session) and the next one still runs.
# Outputs under $OUT (default ./multi_gpu_out), at most 8 files whatever the stages:
#   summary.md            GPUs, versions, each stage's command, exit status, seconds and last lines
#   tests.log             NCCL suites (FSDP2, both EP dispatchers, Muon + QB at N = 2, 4, 8 as N allows),
#                         KCP on a GPU, and the gloo suites of KCP, MLA/model CP and sharded checkpoints
#   bench.md              benchmarks/ep.py --world N --nccl, then benchmarks/context_parallel.py --device cuda;
#                         the fla stage adds benchmarks/kcp_fla.py's table (KCP vs fla's cp_context; fla's wheels
#                         are installed offline from $FLA_WHEELS, default .whl/, when fla does not import)
#   dist_parity.{json,md,png}   k3-small, 100 steps: dp1 (seeds 0, 1), FSDP2, +EP, +CP, +EP+CP
#   dist_scaling.{json,md}      k3-1b weak scaling N = 1..N, KCP longest sequence per N
# Stage budgets in seconds (T_TESTS 280, T_TESTS_GLOO 120, T_BENCH_EP 60, T_BENCH_CP 90, T_PARITY 560,
# T_SCALING 380, T_FLA 150 plus 60 to install) fit a 10-minute limit per command as three commands:
#   scripts/multi_gpu.sh N tests bench;  scripts/multi_gpu.sh N parity;  scripts/multi_gpu.sh N scaling fla
set -uo pipefail
cd "$(dirname "$0")/.."
N="${1:?usage: scripts/multi_gpu.sh N [tests bench fla parity scaling]}"
shift
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests bench fla parity scaling)
case "$N" in 2 | 4 | 8) ;; *) echo "multi_gpu.sh: N must be 2, 4 or 8, got '$N'" >&2; exit 2 ;; esac
found=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$found" -lt "$N" ]; then
  echo "multi_gpu.sh: $N GPUs asked, $found found" >&2
  exit 2
fi
OUT="${OUT:-$PWD/multi_gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((N - 1)))}"
summary="$OUT/summary.md"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if [ ! -f "$summary" ]; then
  {
    echo "# openk3 multi-GPU run ($N GPUs)"
    echo
    echo '```'
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    python -c "import torch, platform; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', '.'.join(map(str, torch.cuda.nccl.version())), 'python', platform.python_version())"
    python -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
    echo "openk3 $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
    echo '```'
  } >"$summary"
fi

# stage NAME BUDGET_S LOG COMMAND...: run COMMAND under `timeout`, append its status to summary.md
stage() {
  local name=$1 budget=$2 log=$3
  shift 3
  local start=$SECONDS
  echo "== $name (budget ${budget} s): $*" | tee -a "$log"
  timeout --kill-after=20 "$budget" "$@" >>"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  {
    echo
    echo "## $name: exit $rc, ${took} s$([ $rc -eq 124 ] && echo ' (timed out)')"
    echo
    echo "\`$*\`"
    echo
    echo '```'
    tail -n 15 "$log"
    echo '```'
  } >>"$summary"
  echo "== $name: exit $rc, ${took} s"
}

for s in "${stages[@]}"; do
  case "$s" in
    tests)
      stage "NCCL test suites" "${T_TESTS:-280}" "$OUT/tests.log" \
        python -m pytest -q -rs -m gpu tests/test_dist_fsdp.py tests/test_dist_ep.py tests/test_dist_optim.py \
        tests/test_dist_kcp.py tests/test_kcp_kernel_summaries.py
      stage "gloo suites: KCP, MLA/model CP, sharded checkpoints" "${T_TESTS_GLOO:-120}" "$OUT/tests.log" \
        python -m pytest -q -m "not gpu" tests/test_dist_kcp.py tests/test_dist_cp_model.py \
        tests/test_dist_checkpoint.py
      ;;
    bench)
      stage "EP dispatchers (benchmarks/ep.py)" "${T_BENCH_EP:-60}" "$OUT/bench.md" \
        python benchmarks/ep.py --world "$N" --nccl --tokens 4096 --width 1024 --ffn 1024 --experts 64 --topk 4
      stage "context parallelism (benchmarks/context_parallel.py)" "${T_BENCH_CP:-90}" "$OUT/bench.md" \
        python benchmarks/context_parallel.py --device cuda --world "$N"
      ;;
    fla)
      wheels="${FLA_WHEELS:-.whl}"
      if ! python -c "import fla.ops.cp" 2>/dev/null; then
        stage "install fla offline from $wheels" 60 "$scratch/fla.log" \
          python -m pip install -q --no-index --no-deps "$wheels"/fla_core-*.whl "$wheels"/flash_linear_attention-*.whl
      fi
      stage "KCP vs fla cp_context (benchmarks/kcp_fla.py)" "${T_FLA:-150}" "$scratch/fla.log" \
        python -m torch.distributed.run --standalone --nproc_per_node "$N" benchmarks/kcp_fla.py \
        --out "$scratch/kcp_fla"
      [ -f "$scratch/kcp_fla.md" ] && cat "$scratch/kcp_fla.md" >>"$OUT/bench.md"
      ;;
    parity)
      stage "loss parity (benchmarks/dist_parity.py)" "${T_PARITY:-560}" "$scratch/parity.log" \
        python benchmarks/dist_parity.py --nccl --world "$N" --preset k3-small --steps 100 \
        --batch-size 16 --seq-len 1024 --run-timeout 150 --out "$OUT/dist_parity"
      ;;
    scaling)
      stage "scaling (benchmarks/dist_scaling.py)" "${T_SCALING:-380}" "$scratch/scaling.log" \
        python benchmarks/dist_scaling.py --nccl --world "$N" --preset k3-1b --batch-per-gpu 4 \
        --seq-len 2048 --steps 4 --warmup 2 --kcp-start 8192 --kcp-max 1048576 --launch-timeout 120 \
        --out "$OUT/dist_scaling"
      ;;
    *)
      echo "multi_gpu.sh: unknown stage '$s' (tests bench fla parity scaling)" >&2
      exit 2
      ;;
  esac
done
echo "outputs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
