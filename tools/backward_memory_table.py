"""Markdown table: gradient bytes per rank at the peak of backward, measured by
``amsp.track_backward_memory`` on 4 CPU ranks (2 per node) against ``cost.backward_peak``.

    python tools/backward_memory_table.py [--micro-batches 2]

TinyLlama, one step, every valid plan at world 4, fp32 and bf16. "measured": the largest
census over all units' gradient hooks and ranks; "max error": the worst single hook and
rank; "first at": where the peak is first reached (unit, micro-batch).
"""

from __future__ import annotations

import argparse

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.backward_memory import measure_backward_memory
from amsp_dtensor.testing.multiproc import run_on_ranks

WORLD, PER_NODE = 4, 2


def _error(measured: int, predicted: int) -> float:
    return 100.0 * (measured - predicted) / predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=2)
    args = parser.parse_args()
    plans = [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(WORLD, PER_NODE)]
    results = run_on_ranks(measure_backward_memory, WORLD, PER_NODE, plans,
                           ("fp32", "bf16"), args.micro_batches)
    print("| plan | dtype | P | predicted grad peak | measured grad peak | error | "
          "max error, every hook | first at (unit, micro-batch) | P + grad peak |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    for key in results[0]:
        plan, dtype, _ = key
        by_rank = [r[key] for r in results]
        measured = max(r["peak"] for r in by_rank)
        predicted = max(r["predicted_peak"] for r in by_rank)
        worst = max(abs(_error(s[3], p[3])) for r in by_rank
                    for s, p in zip(r["samples"], r["predicted"]))
        first = by_rank[0]
        at = next(s for s in first["samples"] if s[3] == first["peak"])
        param = max(r["param"] for r in by_rank)
        name = "p{}-g{}-os{}".format(*plan)
        print(f"| {name} | {dtype} | {param:,} | {predicted:,} | {measured:,} | "
              f"{_error(measured, predicted):+.1f}% | {worst:.1f}% | {at[0]}, {at[1]} | "
              f"{param + measured:,} |")


if __name__ == "__main__":
    main()
