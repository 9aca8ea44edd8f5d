"""Measure the demo draft: mean accepted length per category (greedy, draft length K) and its step-time ratio.

At temperature 0 a speculative step accepts the draft's tokens up to its first disagreement with the target's
greedy choice, and the draft's context is always the target's own text. So the accepted lengths follow exactly
from (a) the target's greedy continuation of each prompt and (b) the draft's greedy prediction at every position
of that text: one batched generation of the target (kept in --ref, reused for every draft) and one prefill of the
draft per prompt. `--engine N` replays the first N prompts through SpeculativeEngine as a cross-check.

    nice -n 19 python scripts/recipes/draft_eval.py TARGET.gguf DRAFT.gguf --ref .cache/draft/ref.npz --engine 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from draft_data import Generator  # noqa: E402

from ggufspec.chat import render_chat  # noqa: E402
from ggufspec.decoder import DecoderOptions, LlamaCppDecoder  # noqa: E402

BENCH = Path(__file__).resolve().parents[2].parent / "shared" / "bench"


def bench_prompts(per_category: int, seed: int) -> list[tuple[str, str, bool]]:
    """(category, text, chat?) for up to `per_category` prompts of every Spec-Bench category, plus HumanEval."""
    rng = random.Random(seed)
    by_cat: dict[str, list[str]] = defaultdict(list)
    for line in open(BENCH / "spec_bench_dev.jsonl"):
        q = json.loads(line)
        by_cat[q["category"]].append(q["turns"][0])
    out = []
    for cat in sorted(by_cat):
        for text in rng.sample(by_cat[cat], min(per_category, len(by_cat[cat]))):
            out.append((cat, text, True))
    he = [json.loads(line)["prompt"] for line in open(BENCH / "humaneval_dev.jsonl")]
    out += [("humaneval", t, False) for t in rng.sample(he, min(per_category, len(he)))]
    return out


def make_ref(target: str, out: str, per_category: int, max_new: int, seed: int) -> None:
    gen = Generator(target, 8, 2048, 2048)
    vocab = gen.vocab
    template = gen.dec.metadata("tokenizer.chat_template")
    stops = {vocab.eos, *vocab.tokenize("<|im_end|>", add_special=False, parse_special=True)}
    prompts, cats = [], []
    for cat, text, chat in bench_prompts(per_category, seed):
        s = render_chat(template, [{"role": "user", "content": text}]) if chat else text
        ids = vocab.tokenize(s, add_special=True, parse_special=True)
        if len(ids) + max_new <= 2048 and len(ids) <= 2040 - 8:
            prompts.append(ids)
            cats.append(cat)
    # Generator.run yields in completion order: tag each prompt by a unique first-token trick is fragile, so
    # match results back by their prompt tokens.
    key = {tuple(p): i for i, p in enumerate(prompts)}
    res: dict[int, tuple[int, np.ndarray]] = {}
    t0 = time.time()
    for plen, toks, *_ in gen.run(list(prompts), max_new, time.time() + 10**6, 0.0, stops):
        res[key[tuple(toks[:plen].tolist())]] = (plen, toks)
        print(f"{len(res)}/{len(prompts)} reference continuations, {time.time() - t0:.0f} s", flush=True)
    order = sorted(res)
    np.savez(out, cats=np.array([cats[i] for i in order]), plens=np.array([res[i][0] for i in order]),
             lens=np.array([len(res[i][1]) for i in order]), tokens=np.concatenate([res[i][1] for i in order]))


def load_ref(path: str):
    d = np.load(path)
    off = 0
    for cat, plen, n in zip(d["cats"], d["plens"], d["lens"]):
        yield str(cat), int(plen), d["tokens"][off : off + n].tolist()
        off += n


def accepted_lengths(matches: list[bool], k: int) -> list[int]:
    """Tokens committed per target pass: consecutive draft matches (at most k) plus the target's own token."""
    out, i, n = [], 0, len(matches)
    while i < n:
        a = 0
        while a < k and i + a < n - 1 and matches[i + a]:
            a += 1
        out.append(a + 1)
        i += a + 1
    return out


def evaluate(draft: str, ref: str, k: int) -> dict[str, tuple[float, float, int]]:
    dec = LlamaCppDecoder(draft, DecoderOptions(n_ctx=2304, n_batch=512, n_threads=1))
    per: dict[str, list[int]] = defaultdict(list)
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for cat, plen, toks in load_ref(ref):
        dec.reset()
        logits = dec.feed(toks[:-1], all_logits=True)
        pred = logits.argmax(-1)
        # Position t of the answer is predicted from tokens[:t]; the draft proposes it after the target's prefix.
        gen = toks[plen:]
        m = [int(pred[plen - 1 + j]) == gen[j] for j in range(len(gen))]
        per[cat] += accepted_lengths(m, k)
        hits[cat][0] += sum(m)
        hits[cat][1] += len(m)
    dec.close()
    return {c: (sum(v) / len(v), hits[c][0] / max(hits[c][1], 1), len(v)) for c, v in sorted(per.items())}


def step_ms(path: str, n: int = 48, reps: int = 3) -> float:
    """Median milliseconds of one single-token decode after a short prompt (1 thread)."""
    dec = LlamaCppDecoder(path, DecoderOptions(n_ctx=512, n_batch=64, n_threads=1))
    times = []
    for _ in range(reps):
        dec.reset()
        dec.feed([1, 504, 3458, 314, 253, 1345], all_logits=False)
        for i in range(n):
            t = time.perf_counter()
            dec.feed([100 + i], all_logits=False)
            times.append(time.perf_counter() - t)
    dec.close()
    return 1000 * statistics.median(times)


def engine_check(target: str, draft: str, ref: str, k: int, n: int) -> None:
    from ggufspec.engine import GenerationSettings, SpeculativeEngine

    eng = SpeculativeEngine.load(target, draft, DecoderOptions(n_ctx=2304, n_threads=1), GenerationSettings(draft_max=k))
    for i, (cat, plen, toks) in enumerate(load_ref(ref)):
        if i >= n:
            break
        text = b"".join(eng.target.vocab.piece(t, special=True) for t in toks[:plen]).decode("utf-8", "replace")
        r = eng.generate(text, GenerationSettings(max_tokens=len(toks) - plen, draft_max=k))
        print(f"engine {cat}: {r.stats.mean_accepted_length:.2f} tok/pass over {r.stats.target_passes} passes, "
              f"same text as the reference: {r.tokens == toks[plen:plen + len(r.tokens)]}", flush=True)
    eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("draft", nargs="?")
    ap.add_argument("--ref", required=True, help="Reference continuations (written when missing).")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("-k", "--draft-max", type=int, default=4)
    ap.add_argument("--engine", type=int, default=0, help="Cross-check the first N prompts with SpeculativeEngine.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not Path(args.ref).exists():
        make_ref(args.target, args.ref, args.per_category, args.max_new, args.seed)
    if not args.draft:
        return
    res = evaluate(args.draft, args.ref, args.draft_max)
    print(f"{'category':16} tok/pass  greedy-agreement  passes")
    for cat, (mal, agree, n) in res.items():
        print(f"{cat:16} {mal:8.2f}  {agree:16.1%}  {n:6d}")
    allm = [v[0] for v in res.values()]
    print(f"{'mean of categories':16} {sum(allm) / len(allm):.2f}; lowest {min(allm):.2f}")
    t, d = step_ms(args.target), step_ms(args.draft)
    print(f"decode step: target {t:.2f} ms, draft {d:.2f} ms, ratio {d / t:.3f} (1 thread, median)")
    if args.engine:
        engine_check(args.target, args.draft, args.ref, args.draft_max, args.engine)


if __name__ == "__main__":
    main()
