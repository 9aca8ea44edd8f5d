"""A method's speed over the baseline's at one decode speed, by category, from `ggufspec bench -o` output.

Where a method's run made the same target passes as the baseline's run of the same prompt and repetition (`auto`
where nothing paid: every pass a plain one, drafted nothing), their decodes did the same work, and what a VM's speed
does to both cancels from (wall / decode) of each (bench_overhead.at_one_decode_speed, here for single runs). On a VM
whose speed moves 10-30% within seconds, raw tok/s ratios of such runs spread 0.88-1.14x by category while this one
spreads a few tenths of a percent. Runs whose passes differ (the method drafted) are counted, not compared.

    python scripts/bench_same_decode.py bench.json --method auto
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import at_one_decode_speed  # noqa: E402


def wall_and_decode(stats: dict) -> tuple[float, float]:
    return stats["generation_seconds"], stats["target_seconds"] + stats["draft_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", help="ggufspec bench -o FILE")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--baseline", default="autoregressive")
    a = ap.parse_args()
    runs = json.load(open(a.bench))["runs"]
    base = {(r["prompt"], r["temperature"], r["repeat"]): r["stats"] for r in runs if r["method"] == a.baseline}
    ratios: dict[tuple[float, str], list[float]] = defaultdict(list)
    drafted: dict[tuple[float, str], int] = defaultdict(int)
    for r in runs:
        b = base.get((r["prompt"], r["temperature"], r["repeat"]))
        if r["method"] != a.method or b is None:
            continue
        key = (r["temperature"], r["category"])
        if r["stats"]["target_passes"] != b["target_passes"] or r["stats"]["drafted"]:
            drafted[key] += 1
            continue
        ratios[key].append(at_one_decode_speed(*wall_and_decode(b), *wall_and_decode(r["stats"])))
    for temp in sorted({t for t, _ in ratios | drafted}):
        every = [x for (t, _), xs in ratios.items() if t == temp for x in xs]
        for cat in sorted({c for t, c in ratios | drafted if t == temp}) + ["all"]:
            xs = every if cat == "all" else ratios.get((temp, cat), [])
            left = sum(n for (t, c), n in drafted.items() if t == temp and cat in (c, "all"))
            row = {"temperature": temp, "category": cat, "compared": len(xs), "drafted_runs": left}
            if xs:
                row |= {"vs_baseline_same_decode": round(statistics.median(xs), 4),
                        "min": round(min(xs), 4), "max": round(max(xs), 4)}
            print(json.dumps(row))


if __name__ == "__main__":
    main()
