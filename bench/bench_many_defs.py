"""Memory and time of a file of many small items: 20,000 one-line ``def``\\ s (about 470 KB).

Each ``def`` keeps a snapshot of the names above it; the snapshot must cost O(1), so the
evaluation's memory grows linearly with the file (it once copied every earlier binding
into every ``def``: 5.2 GB for such a file). Prints the file's size, the seconds to parse
and to evaluate, and the evaluation's peak traced memory.

    python bench/bench_many_defs.py [--defs N]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

from timing import record

from pipedsl.lang import evaluate, parse_source


def _text(n: int) -> str:
    defs = "\n".join(f"  def g{i}(x) = x + a" for i in range(n))
    return f"schedule s() {{\n  a = 1\n{defs}\n  stages 1 devices 1 place s -> 0\n  on device d {{ F(0) B(0) }}\n}}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--defs", type=int, default=20_000, help="one-line defs in the file (default 20,000)")
    args = parser.parse_args()
    text = _text(args.defs)
    start = time.perf_counter()
    module = parse_source(text)
    parsed = time.perf_counter()
    tracemalloc.start()
    evaluate(module)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    evaluated = time.perf_counter()
    print(f"file:      {args.defs:,} defs, {len(text) / 1e3:.0f} KB")
    print(f"parse:     {parsed - start:.2f} s")
    print(f"evaluate:  {evaluated - parsed:.2f} s (traced)")
    print(f"peak:      {peak / 2**20:.1f} MiB while evaluating")
    record("bench_many_defs", {"defs": args.defs, "parse_s": parsed - start, "evaluate_s": evaluated - parsed,
                               "peak_mib": peak / 2**20})  # fmt: skip


if __name__ == "__main__":
    main()
