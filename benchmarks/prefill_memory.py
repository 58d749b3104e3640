"""Peak memory and time of :func:`openk3.generate.generate` on a long prompt, prefilled in one pass or in pieces
of ``prefill_chunk`` tokens (k3-tiny, random weights, fp32, CPU). Each setting runs in a fresh process, so its
peak resident set size is its own.

    python benchmarks/prefill_memory.py [--tokens 8192] [--chunks 0,2048]

Prints, per chunk size (0 = the whole prompt in one pass), the peak RSS in GB, the seconds to prefill and
generate 4 tokens, and the 4 greedy tokens (equal across settings: chunked prefill is exact).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

RUN = """
import resource, time, torch, openk3
m = openk3.build_model(openk3.get_preset("k3-tiny"), seed=0).eval()
ids = torch.randint(0, 1000, (1, {tokens}), generator=torch.Generator().manual_seed(0))
t = time.perf_counter()
out = openk3.generate.generate(m, ids, 4, prefill_chunk={chunk})
print(f"{{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f}} GB, "
      f"{{time.perf_counter() - t:.1f}} s, tokens {{out.tolist()[0]}}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length")
    parser.add_argument("--chunks", default="0,2048", help="comma list of prefill_chunk values (0: one pass)")
    args = parser.parse_args()
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        parser.error(f"--chunks must be a comma list of ints, got {args.chunks!r}")
    if args.tokens < 1 or any(c < 0 for c in chunks):
        parser.error("--tokens must be >= 1 and every --chunks value >= 0")
    for chunk in chunks:
        code = RUN.format(tokens=args.tokens, chunk=chunk or args.tokens)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        line = result.stdout.strip() or result.stderr.strip().splitlines()[-1]
        print(f"tokens {args.tokens}, prefill_chunk {chunk or 'one pass'}: {line}", flush=True)


if __name__ == "__main__":
    main()
