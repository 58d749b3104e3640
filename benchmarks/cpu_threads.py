"""CPU training-step time of k3-tiny under three OpenMP settings: 2 spinning threads (the default), 2 threads
with ``OMP_WAIT_POLICY=PASSIVE``, and one thread. Each setting runs in a fresh process (the policy is read when
torch's OpenMP runtime loads). ``--hog`` keeps one core busy with a spinning process during the
measurement, as another job on a shared machine would.

    python benchmarks/cpu_threads.py [--steps 4] [--hog]

Prints seconds per forward+backward step (batch 16 × 64 tokens, median of ``--steps`` after one warm-up).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

STEP = """
import statistics, time, torch, openk3
m = openk3.build_model(openk3.get_preset("k3-tiny"), seed=0)
ids = torch.randint(0, m.config.vocab_size if hasattr(m.config, "vocab_size") else 8000, (16, 64))
def step():
    m(ids).logits.float().logsumexp(-1).mean().backward()
step()
ts = []
for _ in range({steps}):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
print(f"{{statistics.median(ts):.2f}}")
"""

SETTINGS = {
    "2 threads, spinning (default)": {"OMP_NUM_THREADS": "2"},
    "2 threads, OMP_WAIT_POLICY=PASSIVE": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hog", action="store_true", help="keep one core busy during the measurement")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    print(f"load average before: {os.getloadavg()[0]:.2f}; hog: {args.hog}")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None
    try:
        run_settings(args.steps)
    finally:
        if hog is not None:
            hog.kill()


def run_settings(steps: int) -> None:
    for name, extra in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
        env.update(extra)
        out = subprocess.run(
            [sys.executable, "-c", STEP.format(steps=steps)], env=env, capture_output=True, text=True
        )
        result = out.stdout.strip() or out.stderr.strip().splitlines()[-1]
        print(f"{name:<38} {result} s/step", flush=True)


if __name__ == "__main__":
    main()
