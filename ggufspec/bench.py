"""Benchmarks: methods side by side on the same prompts, interleaved, medians over repetitions.

Each repetition runs every prompt with every method back to back, so slow phases of a
noisy machine hit all methods alike; speedups are ratios within one run. Every figure of
the table comes with its spread over repetitions (see `summarize`), and `spread_warning`
says when that spread, or the baseline's speed from run to run, is too wide to trust.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from importlib import resources
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .batch_jobs import engine_prompt, read_prompts
from .engine import GenerationSettings, Prompt, SpeculativeEngine
from .proposers import AnswerPool
from .sampling import SamplingParams


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a benchmark: its id, its category (a row of the table) and what the engine gets."""

    id: str
    category: str
    prompt: Prompt  # chat messages go through the chat template; text and token ids do not (completions)


@dataclass
class BenchConfig:
    methods: tuple[str, ...] = ("autoregressive", "auto")  # the CLI's default: default_methods()
    temperatures: tuple[float, ...] = (0.0,)
    max_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    draft_max: int = 4
    draft_p_min: float = 0.0
    seed: int = 0
    fresh: bool = False  # clear both KV caches before every run (no prefix reuse, same cell layout for all)
    medusa_tree: str | None = None


@dataclass
class Run:
    """One generation: which prompt, method, temperature and repetition, and its stats."""

    prompt: str
    category: str
    method: str
    temperature: float
    repeat: int
    tokens: list[int] = field(repr=False)
    stats: dict[str, float]


def default_prompts() -> Path:
    """The built-in prompt set `bench` runs without -p: eight short prompts of six categories, in the shapes
    `generate --batch` reads (Spec-Bench's `turns`, HumanEval's `prompt`, chat `messages`)."""
    return Path(str(resources.files("ggufspec") / "prompts" / "bench.jsonl"))


def load_prompts(path: str | Path | None = None, limit: int | None = None,
                 per_category: int | None = None) -> list[BenchPrompt]:
    """The prompts of `path` (None: default_prompts()), read as `generate --batch` reads its file
    (batch_jobs.read_prompts: JSON lines with `messages`, `turns` or `prompt` and an id, or text lines), so a bad
    line is a GGUFSpecError naming it. Chat messages and `turns` go through the chat template; text lines and
    `prompt` text are completions, as HumanEval's prompts are. A prompt's category is its `category` field, else
    the file's name without its suffix.

    per_category keeps the first N prompts of each category; limit then keeps the first N of those.
    """
    p = Path(path) if path is not None else default_prompts()
    out = [BenchPrompt(str(b.id), b.category or p.stem, engine_prompt(b, templated=False, system=None))
           for b in read_prompts(p)]
    if per_category:
        seen: Counter[str] = Counter()
        kept = []
        for b in out:
            seen[b.category] += 1
            if seen[b.category] <= per_category:
                kept.append(b)
        out = kept
    return out[:limit] if limit else out


def default_methods(has_draft: bool, has_heads: bool, has_mtp: bool = False) -> tuple[str, ...]:
    """What `bench` compares when no --method is given: the baseline, each method that uses what is loaded on
    its own (vanilla with a draft model, medusa with heads, mtp with the target's MTP head), and `auto`, the default
    of generate/chat/serve (with none of them, `auto` is prompt lookup where the cost model expects it to pay, else
    plain decoding)."""
    return (("autoregressive",) + (("vanilla",) if has_draft else ()) + (("medusa",) if has_heads else ())
            + (("mtp",) if has_mtp else ()) + ("auto",))


def run_bench(
    engine: SpeculativeEngine, prompts: list[BenchPrompt], cfg: BenchConfig,
    progress: Callable[[int], None] | None = None,
) -> list[Run]:
    """All runs; the warm-up repetitions (first prompts only) are not recorded."""
    runs: list[Run] = []
    for temp in cfg.temperatures:
        for rep in range(-cfg.warmup, cfg.repeats):
            for prompt in prompts if rep >= 0 else prompts[:2]:
                for method in cfg.methods:
                    settings = GenerationSettings(
                        max_tokens=cfg.max_tokens, sampling=SamplingParams(temperature=temp), method=method,
                        draft_max=cfg.draft_max, draft_p_min=cfg.draft_p_min, seed=cfg.seed + cfg.warmup + rep,
                        medusa_tree=cfg.medusa_tree,
                    )
                    if cfg.fresh:
                        engine.reset()
                    # no earlier answers: `auto`'s lookup would copy this prompt's answer from its last run (another
                    # method's, or an earlier repetition's), which no real prompt has to copy
                    engine.answers = AnswerPool()
                    result = engine.generate(prompt.prompt, settings)
                    if rep >= 0:
                        runs.append(Run(prompt.id, prompt.category, method, temp, rep, result.tokens,
                                        result.stats.to_dict()))
                        if progress:
                            progress(1)
    return runs


# A cell's spread is "wide" past these: its range over repetitions against its median (the baseline's tok/s, the
# others' speedups), and the baseline's fastest single run against its slowest (decoding one token at a time with
# one model should not vary 2x between prompts).
SPREAD_WARN = 0.20
RUN_SPEED_WARN = 2.0


@dataclass
class Summary:
    """Aggregates of one (method, temperature, category): medians over repetitions, with their range.

    Each repetition gives one value per figure: tok/s pooled over the cell's prompts (all tokens over all
    seconds) and the speedup, that tok/s over the baseline's pooled tok/s in the same repetition (whose runs were
    interleaved with these, prompt by prompt). `tokens_per_s` and `speedup` are the medians of those values and
    `*_min`/`*_max` their range: min-max over repetitions, not mean +- stdev, because a speedup is a ratio (its
    spread is not symmetric) and three repetitions give no meaningful stdev. Every repetition runs the same
    prompts, so the range is run-to-run noise (at temperature > 0 also the seeds'), not the prompts' different
    speedups, which are the cell's content. With one repetition the range is a single value (the table then shows
    no range). `run_tokens_per_s_min/max` is the range of single runs
    (every prompt and repetition): for the baseline it shows a busy machine even with --repeats 1.
    """

    method: str
    temperature: float
    category: str
    prompts: int
    tokens_per_s: float
    speedup: float
    acceptance_rate: float
    mean_accepted_length: float
    draft_share: float
    target_share: float
    engine_share: float
    engine_ms_per_token: float
    same_tokens_as_baseline: float | None
    acceptance_by_position: list[float] = field(default_factory=list)
    repeats: int = 1
    tokens_per_s_min: float = float("nan")
    tokens_per_s_max: float = float("nan")
    speedup_min: float = float("nan")
    speedup_max: float = float("nan")
    run_tokens_per_s_min: float = float("nan")
    run_tokens_per_s_max: float = float("nan")
    acceptance_by_position_min: list[float] = field(default_factory=list)  # per position, over repetitions
    acceptance_by_position_max: list[float] = field(default_factory=list)

    @property
    def tokens_per_s_spread(self) -> float:
        """Range over repetitions relative to the median (0 with one repetition)."""
        return _relative(self.tokens_per_s_min, self.tokens_per_s_max, self.tokens_per_s)

    @property
    def speedup_spread(self) -> float:
        return _relative(self.speedup_min, self.speedup_max, self.speedup)


def _relative(lo: float, hi: float, mid: float) -> float:
    spread = (hi - lo) / mid if mid else float("nan")
    return spread if spread == spread else 0.0  # nan (no baseline): no spread to report


def _pooled(runs: Iterable[Run]) -> dict[str, float]:
    runs = list(runs)
    total = {k: sum(r.stats[k] for r in runs) for k in
             ("generated_tokens", "generation_seconds", "draft_seconds", "target_seconds", "drafted", "accepted",
              "target_passes")}
    secs = total["generation_seconds"] or 1e-9
    engine = max(0.0, secs - total["draft_seconds"] - total["target_seconds"])
    committed = sum(r.stats.get("committed_tokens", r.stats["generated_tokens"]) for r in runs)  # a stop token too
    return {
        "tps": total["generated_tokens"] / secs,
        "acc": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "mal": committed / total["target_passes"] if total["target_passes"] else 0.0,
        "draft": total["draft_seconds"] / secs, "target": total["target_seconds"] / secs, "engine": engine / secs,
        "engine_ms": 1000 * engine / max(1, total["generated_tokens"]),
    }


def _by_position(runs: list[Run]) -> list[float]:
    """Acceptance by draft position, pooled over runs: kept / judged at each position."""
    n = max((len(r.stats["judged_at"]) for r in runs), default=0)
    judged, kept = np.zeros(n), np.zeros(n)
    for r in runs:
        judged[: len(r.stats["judged_at"])] += r.stats["judged_at"]
        kept[: len(r.stats["accepted_at"])] += r.stats["accepted_at"]
    return (kept / np.maximum(judged, 1)).round(4).tolist()


def _position_range(per_rep: list[list[float]], n: int) -> tuple[list[float], list[float]]:
    """Elementwise min and max over repetitions of acceptance by position (positions a repetition never reached
    left out of it)."""
    lo, hi = [], []
    for i in range(n):
        vals = [p[i] for p in per_rep if i < len(p)]
        lo.append(min(vals))
        hi.append(max(vals))
    return lo, hi


def _run_tps(r: Run) -> float | None:
    secs = r.stats["generation_seconds"]
    return r.stats["generated_tokens"] / secs if secs > 0 and r.stats["generated_tokens"] > 0 else None


def summarize(runs: list[Run], baseline: str = "autoregressive") -> list[Summary]:
    """Per category and overall ("all"): pooled figures of each repetition, then the median over repetitions and
    the range (see Summary)."""
    out: list[Summary] = []
    keys = sorted({(r.method, r.temperature) for r in runs})
    categories = sorted({r.category for r in runs}) + ["all"]
    for temp in sorted({t for _, t in keys}):
        for cat in categories:
            sel = [r for r in runs if r.temperature == temp and (cat == "all" or r.category == cat)]
            if not sel:
                continue
            reps = sorted({r.repeat for r in sel})
            pooled: dict[str, list[dict[str, float]]] = {
                method: [_pooled(r for r in sel if r.method == method and r.repeat == k) for k in reps]
                for method in dict.fromkeys(r.method for r in sel)
            }
            base = pooled.get(baseline)
            ref = {(r.prompt, r.repeat): r.tokens for r in sel if r.method == baseline}
            for method, per_rep in pooled.items():
                m = {k: statistics.median(p[k] for p in per_rep) for k in per_rep[0]}
                tps = [p["tps"] for p in per_rep]
                speedups = ([p["tps"] / b["tps"] if b["tps"] else float("nan") for p, b in zip(per_rep, base)]
                            if base else [float("nan")])
                mine = [r for r in sel if r.method == method]
                same = None
                if temp == 0 and ref and method != baseline:
                    same = sum(ref.get((r.prompt, r.repeat)) == r.tokens for r in mine) / len(mine)
                by_pos = _by_position(mine)
                pos_lo, pos_hi = _position_range(
                    [_by_position([r for r in mine if r.repeat == k]) for k in reps], len(by_pos))
                run_tps = [v for v in map(_run_tps, mine) if v is not None] or [float("nan")]
                out.append(Summary(
                    method, temp, cat, len({r.prompt for r in sel}), m["tps"], statistics.median(speedups),
                    m["acc"], m["mal"], m["draft"], m["target"], m["engine"], m["engine_ms"], same, by_pos,
                    repeats=len(reps), tokens_per_s_min=min(tps), tokens_per_s_max=max(tps),
                    speedup_min=min(speedups), speedup_max=max(speedups),
                    run_tokens_per_s_min=min(run_tps), run_tokens_per_s_max=max(run_tps),
                    acceptance_by_position_min=pos_lo, acceptance_by_position_max=pos_hi,
                ))
    return out


def _cell_spread(r: Summary, baseline: str) -> float:
    """What a cell's figure is trusted by: the baseline's tok/s (the machine's own noise), every other method's
    speedup (the headline; a slow phase that hits both runs of a pair cancels out of it)."""
    return r.tokens_per_s_spread if r.method == baseline else r.speedup_spread


def spread_warning(rows: list[Summary], baseline: str = "autoregressive") -> str | None:
    """One line naming the cell whose spread is widest, when any is past SPREAD_WARN (range over repetitions against
    the median: of the baseline's tok/s, of the others' speedups), or when the baseline's single runs differ by more
    than RUN_SPEED_WARN times (a loaded machine shows there even with one repetition); None when all is tight."""
    issues = []
    wide = sorted(((_cell_spread(r, baseline), r) for r in rows
                   if r.repeats > 1 and _cell_spread(r, baseline) > SPREAD_WARN), key=lambda x: -x[0])
    if wide:
        spread, r = wide[0]
        what = (f"{r.tokens_per_s:.2f} tok/s, {r.tokens_per_s_min:.2f}-{r.tokens_per_s_max:.2f}"
                if r.method == baseline else f"speedup {r.speedup:.2f}x, {r.speedup_min:.2f}-{r.speedup_max:.2f}x")
        more = f"; {len(wide) - 1} more cells over {SPREAD_WARN:.0%}" if len(wide) > 1 else ""
        issues.append(f"temp {r.temperature:g} {r.category} {r.method}: {what} over {r.repeats} repeats "
                      f"({spread:.0%} of the median){more}")
    for r in rows:
        lo, hi = r.run_tokens_per_s_min, r.run_tokens_per_s_max
        if r.method == baseline and r.category == "all" and lo > 0 and hi / lo > RUN_SPEED_WARN:
            issues.append(f"temp {r.temperature:g} all {r.method}: single runs went from {lo:.2f} to {hi:.2f} tok/s")
    if not issues:
        return None
    return ("warning: wide spread (" + "; ".join(issues) + "): these figures are unreliable; rerun with more "
            "--repeats on a quiet machine (nothing else running, fixed -t threads).")


def _range(lo: float, hi: float, repeats: int, suffix: str = "") -> str:
    return "-" if repeats < 2 or lo != lo else f"{lo:.2f}-{hi:.2f}{suffix}"


def format_table(rows: list[Summary]) -> str:
    """Median over repetitions, and after tok/s and speedup their min-max over repetitions."""
    head = (f"{'temp':>4} {'category':<14} {'method':<15} {'n':>3} {'tok/s':>7} {'(min-max)':>13} {'speedup':>7} "
            f"{'(min-max)':>11} {'accept':>7} {'tok/pass':>8} {'draft':>6} {'target':>6} {'engine':>6} "
            f"{'eng ms/tok':>10} {'same':>5}  accept by position")
    lines = [head, "-" * len(head)]
    for r in rows:
        same = "" if r.same_tokens_as_baseline is None else f"{r.same_tokens_as_baseline:.0%}"
        lines.append(
            f"{r.temperature:>4.1f} {r.category:<14.14} {r.method:<15} {r.prompts:>3} {r.tokens_per_s:>7.2f} "
            f"{_range(r.tokens_per_s_min, r.tokens_per_s_max, r.repeats):>13} {r.speedup:>6.2f}x "
            f"{_range(r.speedup_min, r.speedup_max, r.repeats, 'x'):>11} "
            f"{r.acceptance_rate:>7.1%} {r.mean_accepted_length:>8.2f} {r.draft_share:>6.0%} "
            f"{r.target_share:>6.0%} {r.engine_share:>6.1%} {r.engine_ms_per_token:>10.3f} {same:>5}  "
            + "/".join(f"{a:.0%}".rstrip("%") for a in r.acceptance_by_position)
        )
    return "\n".join(lines)


def to_json(cfg: BenchConfig, runs: list[Run], rows: list[Summary], meta: dict[str, object]) -> str:
    return json.dumps({"config": asdict(cfg), "meta": meta, "summary": [asdict(r) for r in rows],
                       "runs": [asdict(r) for r in runs]}, indent=1)
