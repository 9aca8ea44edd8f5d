"""Benchmarks: methods side by side on the same prompts, interleaved, medians over repetitions.

Each repetition runs every prompt with every method back to back, so slow phases of a
noisy machine hit all methods alike; speedups are ratios within one run.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .engine import GenerationSettings, SpeculativeEngine
from .errors import GGUFSpecError
from .sampling import SamplingParams


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str
    chat: bool  # instruction prompts go through the chat template; completions do not


@dataclass
class BenchConfig:
    methods: tuple[str, ...] = ("autoregressive", "vanilla")
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


def load_prompts(path: str | Path, limit: int | None = None, per_category: int | None = None) -> list[BenchPrompt]:
    """JSONL with `turns` (Spec-Bench: first turn, chat) or `prompt` (HumanEval: completion), or text lines.

    per_category keeps the first N prompts of each category; limit then keeps the first N of those.
    """
    p = Path(path)
    if not p.is_file():
        raise GGUFSpecError(f"{p}: no such prompt file.")
    out: list[BenchPrompt] = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise GGUFSpecError(f"{p}:{i + 1}: not JSON ({e.msg}).") from None
            pid = str(obj.get("question_id", obj.get("task_id", i)))
            if "turns" in obj:
                out.append(BenchPrompt(pid, obj.get("category", "all"), obj["turns"][0], True))
            elif "prompt" in obj:
                out.append(BenchPrompt(pid, obj.get("category", p.stem), obj["prompt"], False))
            else:
                raise GGUFSpecError(f"{p}:{i + 1}: needs a `turns` or a `prompt` field.")
        else:
            out.append(BenchPrompt(str(i), p.stem, line, False))
    if not out:
        raise GGUFSpecError(f"{p}: no prompts in it.")
    if per_category:
        seen: Counter[str] = Counter()
        kept = []
        for b in out:
            seen[b.category] += 1
            if seen[b.category] <= per_category:
                kept.append(b)
        out = kept
    return out[:limit] if limit else out


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
                    text = [{"role": "user", "content": prompt.text}] if prompt.chat else prompt.text
                    result = engine.generate(text, settings)
                    if rep >= 0:
                        runs.append(Run(prompt.id, prompt.category, method, temp, rep, result.tokens,
                                        result.stats.to_dict()))
                        if progress:
                            progress(1)
    return runs


@dataclass
class Summary:
    """Aggregates of one (method, temperature, category): medians over repetitions."""

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


def _pooled(runs: Iterable[Run]) -> dict[str, float]:
    runs = list(runs)
    total = {k: sum(r.stats[k] for r in runs) for k in
             ("generated_tokens", "generation_seconds", "draft_seconds", "target_seconds", "drafted", "accepted",
              "target_passes")}
    secs = total["generation_seconds"] or 1e-9
    engine = max(0.0, secs - total["draft_seconds"] - total["target_seconds"])
    return {
        "tps": total["generated_tokens"] / secs,
        "acc": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "mal": total["generated_tokens"] / total["target_passes"] if total["target_passes"] else 0.0,
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


def summarize(runs: list[Run], baseline: str = "autoregressive") -> list[Summary]:
    """Per category and overall ("all"): pooled tok/s of each repetition, then the median over repetitions."""
    out: list[Summary] = []
    keys = sorted({(r.method, r.temperature) for r in runs})
    categories = sorted({r.category for r in runs}) + ["all"]
    for temp in sorted({t for _, t in keys}):
        for cat in categories:
            sel = [r for r in runs if r.temperature == temp and (cat == "all" or r.category == cat)]
            if not sel:
                continue
            reps = sorted({r.repeat for r in sel})
            per_method: dict[str, dict[str, float]] = {}
            for method in dict.fromkeys(r.method for r in sel):
                pooled = [_pooled(r for r in sel if r.method == method and r.repeat == k) for k in reps]
                per_method[method] = {m: statistics.median(p[m] for p in pooled) for m in pooled[0]}
            base_tps = per_method.get(baseline, {}).get("tps")
            ref = {(r.prompt, r.repeat): r.tokens for r in sel if r.method == baseline}
            for method, m in per_method.items():
                same = None
                if temp == 0 and ref and method != baseline:
                    mine = [r for r in sel if r.method == method]
                    same = sum(ref.get((r.prompt, r.repeat)) == r.tokens for r in mine) / len(mine)
                out.append(Summary(
                    method, temp, cat, len({r.prompt for r in sel}), m["tps"],
                    m["tps"] / base_tps if base_tps else float("nan"), m["acc"], m["mal"], m["draft"], m["target"],
                    m["engine"], m["engine_ms"], same,
                    _by_position([r for r in sel if r.method == method]),
                ))
    return out


def format_table(rows: list[Summary]) -> str:
    head = (f"{'temp':>4} {'category':<14} {'method':<15} {'n':>3} {'tok/s':>7} {'speedup':>7} {'accept':>7} "
            f"{'tok/pass':>8} {'draft':>6} {'target':>6} {'engine':>6} {'eng ms/tok':>10} {'same':>5}  accept by position")
    lines = [head, "-" * len(head)]
    for r in rows:
        same = "" if r.same_tokens_as_baseline is None else f"{r.same_tokens_as_baseline:.0%}"
        lines.append(
            f"{r.temperature:>4.1f} {r.category:<14.14} {r.method:<15} {r.prompts:>3} {r.tokens_per_s:>7.2f} "
            f"{r.speedup:>6.2f}x {r.acceptance_rate:>7.1%} {r.mean_accepted_length:>8.2f} {r.draft_share:>6.0%} "
            f"{r.target_share:>6.0%} {r.engine_share:>6.1%} {r.engine_ms_per_token:>10.3f} {same:>5}  "
            + "/".join(f"{a:.0%}".rstrip("%") for a in r.acceptance_by_position)
        )
    return "\n".join(lines)


def to_json(cfg: BenchConfig, runs: list[Run], rows: list[Summary], meta: dict[str, object]) -> str:
    return json.dumps({"config": asdict(cfg), "meta": meta, "summary": [asdict(r) for r in rows],
                       "runs": [asdict(r) for r in runs]}, indent=1)
