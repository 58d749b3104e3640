#!/usr/bin/env bash
# Quickstart command 1: install, train k3-tiny on Shakespeare (CPU, about 10 minutes), then sample.
# Arguments go to `openk3 train`. Run again on a folder that already holds a run, it skips training and samples
# (start fresh with `rm -r RUN` or another --out; continue an interrupted run with --resume).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch's OpenMP threads spin while they wait: a little faster on idle cores, far slower once another job
# competes (benchmarks/results/cpu_threads.md; a trial saw 94 s a step where sleeping threads took 4-8 s,
# docs/LOG.md 2026-12-03). Other jobs may start after launch, so the threads always sleep unless you set it.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
bash scripts/install.sh
run=runs/k3-tiny
resume=0
args=("$@")
for i in "${!args[@]}"; do
  case "${args[$i]}" in
    --out) run=${args[$((i + 1))]:-$run} ;;
    --out=*) run=${args[$i]#--out=} ;;
    --resume) resume=1 ;;
  esac
done
if [ "$resume" = 0 ] && [ -f "$run/checkpoints/latest" ]; then
  echo "$run already holds a trained run: skipping training, sampling from it."
  echo "  start fresh: rm -r $run (or pass --out runs/NEW); continue an interrupted run, or extend a finished one"
  echo "  with a larger --steps: add --resume"
else
  # a Ctrl-C's resume line names this script, which also samples, not openk3 train
  resume_command="bash scripts/quickstart.sh --resume"
  if [ "$run" != runs/k3-tiny ]; then
    resume_command="bash scripts/quickstart.sh --out $(printf %q "$run") --resume"
  fi
  openk3 train --resume-command "$resume_command" "$@"
fi
echo "--- sample: openk3 generate --ckpt $run ---"
openk3 generate --ckpt "$run" --prompt "KING HENRY:" --max-new-tokens 200 --temperature 0.8 --top-p 0.95 --seed 0
