"""The estimator on published runs that nothing was fitted on: the GPU runs held out of every
fit (``data/heldout_runs*.csv``) and the ``validate`` rows of the TPU runs
(``data/tpu_runs*.csv``), each predicted with the cluster presets as they are, as
``pipedsl estimate`` prices them.

Prints every run's measured and predicted seconds per step, its error and its memory
verdict, then per set (GPU, TPU) the mean absolute error, the worst error and how many runs
the estimator judges to fit; appends the figures to
``bench/results/published_heldout.jsonl`` (or ``$PIPEDSL_RESULTS_DIR``) with the command.
Every run is cited in ``data/README.md``.

    python bench/published_heldout.py [--no-record]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def held_out() -> dict[str, list[Any]]:
    """The runs held out of every fit, by set (``gpu``, ``tpu``), as fit results."""
    from pipedsl.simulator.fit_published import DATA, HELD_OUT_GPU, TPU_RUNS, evaluate, load_runs
    from pipedsl.simulator.hardware import load_cluster

    sets = {
        "gpu": load_runs(DATA, HELD_OUT_GPU),
        "tpu": [r for r in load_runs(DATA, TPU_RUNS) if r.role == "validate"],
    }
    clusters = {name: load_cluster(name) for name in {r.cluster for runs in sets.values() for r in runs}}
    return {name: evaluate(runs, clusters) for name, runs in sets.items()}


def summary(results: Sequence[Any]) -> dict[str, float]:
    """Mean absolute error, worst error (signed) and runs that fit, of ``results``."""
    worst = max(results, key=lambda r: abs(r.error))
    return {
        "runs": len(results),
        "mean_abs_error": sum(abs(r.error) for r in results) / len(results),
        "worst_error": worst.error,
        "fit": sum(1 for r in results if r.fits),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-record", action="store_true", help="print only, append nothing to bench/results")
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    for name, results in held_out().items():
        print(f"\n{name}: {'run':34} {'source':26} {'measured s':>10} {'predicted s':>11} {'error':>7}  fits")
        for r in results:
            print(
                f"     {r.run.name:34} {r.run.source:26} {r.run.measured_s:10.3f} {r.predicted_s:11.3f} "
                f"{100 * r.error:+6.1f}%  {'yes' if r.fits else 'no'}"
            )
            figures[f"{name}:{r.run.name}_error"] = r.error
        found = summary(results)
        figures |= {f"{name}_{key}": value for key, value in found.items()}
        print(
            f"{name}: {found['runs']} runs, mean absolute error {100 * found['mean_abs_error']:.1f}%, worst "
            f"{100 * found['worst_error']:+.1f}%, {found['fit']} of {found['runs']} judged to fit"
        )
    if not args.no_record:
        from timing import record

        record("published_heldout", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
