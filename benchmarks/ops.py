"""The ops benchmark: KDA, sparse attention and MoE against their peers, side by side in one run.

    python -m benchmarks.ops [--threads 2]

Each variant runs forward + backward in fp32 in a fresh process (benchmarks/harness.py), so peak memory
is the peak-RSS increase of that process. The lines go to stdout and to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse

from benchmarks import ops_dsa, ops_kda, ops_moe
from benchmarks.harness import write_results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--kda-T", type=int, default=4096)
    parser.add_argument("--dsa-T", type=int, default=8192)
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    lines = []
    lines += ops_kda.main(T=args.kda_T, threads=args.threads, iters=args.iters)
    lines += ops_moe.main(threads=args.threads, iters=max(args.iters, 15))  # ~0.1 s steps: more samples
    lines += ops_dsa.main(threads=args.threads, iters=args.iters, T=args.dsa_T)
    if not args.no_write:
        write_results("ops (benchmarks/ops.py)", lines)


if __name__ == "__main__":
    main()
