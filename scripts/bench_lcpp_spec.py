#!/usr/bin/env python3
"""llama.cpp's own speculative decoding (`llama-speculative-simple`, a binary you built) on the prompts `ggufspec
bench` runs, for a comparison within one run (docs/mtp.md, "What it costs").

Each prompt is read as `ggufspec bench -p FILE --per-category N` reads it and rendered into token ids by the engine
(chat messages through the GGUF's template); the same ids go into PROMPTS.jsonl for `ggufspec bench` (`prompt` as a
list of ids) and, as text, to llama.cpp (whose `encoded N tokens` is checked against the ids). Per prompt and
repetition it runs the binary once and reads its `decoded N tokens in S seconds` (generation only, as bench's tok/s)
and `n_drafted`/`n_accept`. Prints one JSON line per run and a summary per category: tok/s pooled over the
category's prompts (all tokens over all seconds), median over repetitions, and the acceptance.

    python scripts/bench_lcpp_spec.py prompts -m T.gguf -p A.jsonl -p B.jsonl --per-category 2 -o PROMPTS.jsonl
    python scripts/bench_lcpp_spec.py run --bin /path/llama-speculative-simple -m T.gguf -P PROMPTS.jsonl -n 64 \\
        --repeats 2 -t 2 -o lcpp.jsonl -- --spec-type draft-mtp --spec-draft-n-max 3
    python scripts/bench_lcpp_spec.py compare --gg bench-1.json --gg bench-2.json --lcpp mtp3=lcpp-mtp3-*.jsonl

`compare` puts the rounds side by side per category: ggufspec's methods (from `ggufspec bench -o` files) and each
named llama.cpp configuration, tok/s pooled over the category's prompts per round, the median over rounds, the
acceptance, and the ratios of `auto` to autoregressive and to the best llama.cpp configuration.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path


def make_prompts(a) -> int:
    from ggufspec.bench import load_prompts
    from ggufspec.decoder import DecoderOptions
    from ggufspec.engine import SpeculativeEngine

    rows = []
    with SpeculativeEngine.load(a.model, None, DecoderOptions(n_ctx=4096)) as engine:
        for path in a.prompts:
            for p in load_prompts(path, per_category=a.per_category):
                ids = engine.encode(p.prompt)
                text = b"".join(engine.target.vocab.piece(t, special=True) for t in ids).decode("utf-8", "replace")
                rows.append({"id": f"{Path(path).stem}-{p.id}", "category": p.category, "prompt": ids, "text": text})
    Path(a.output).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {a.output}: {len(rows)} prompts", file=sys.stderr)
    return 0


DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ENCODED = re.compile(r"encoded\s+(\d+) tokens")
COUNT = re.compile(r"\b(n_drafted|n_accept)\s*=\s*(\d+)")


def run(a, extra: list[str]) -> int:
    rows = [json.loads(x) for x in Path(a.prompts_file).read_text().splitlines() if x.strip()]
    out = open(a.output, "a") if a.output else None
    cells: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for rep in range(a.repeats):
        for r in rows:
            # -p, not -f: llama.cpp drops a prompt file's last newline; --no-escape: a code prompt's "\\n" stays
            cmd = [a.bin, "-m", a.model, "-p", r["text"], "--no-escape", "-n", str(a.n), "-t", str(a.threads),
                   "-c", str(a.ctx), "--temp", "0", *extra]
            t0 = time.time()
            p = subprocess.run(cmd, capture_output=True, text=True, errors="replace")  # random text: broken UTF-8
            log = p.stdout + p.stderr
            dec, enc = DECODED.search(log), ENCODED.search(log)
            if p.returncode != 0 or not dec:
                print(log[-3000:], file=sys.stderr)
                raise SystemExit(f"{cmd[0]} failed on {r['id']} (exit {p.returncode})")
            counts = dict((k, int(v)) for k, v in COUNT.findall(log))
            res = {"id": r["id"], "category": r["category"], "rep": rep, "tokens": int(dec[1]),
                   "seconds": float(dec[2]), "prompt_tokens": len(r["prompt"]),
                   "encoded": int(enc[1]) if enc else None, "drafted": counts.get("n_drafted", 0),
                   "accepted": counts.get("n_accept", 0), "wall": time.time() - t0}
            if res["encoded"] != res["prompt_tokens"]:
                print(f"note: {r['id']}: llama.cpp read {res['encoded']} prompt tokens, ggufspec "
                      f"{res['prompt_tokens']}", file=sys.stderr)
            cells[(r["category"], rep)].append(res)
            line = json.dumps(res)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
                out.flush()
    summary(cells)
    return 0


def summary(cells: dict[tuple[str, int], list[dict]]) -> None:
    cats = sorted({c for c, _ in cells})
    everything = defaultdict(list)
    print(f"{'category':<16} {'tok/s':>7} {'min-max':>13} {'accept':>7}")
    for c in cats + ["all"]:
        reps = sorted({r for _, r in cells})
        speeds, drafted, accepted = [], 0, 0
        for rep in reps:
            runs = [x for (cc, rr), xs in cells.items() if rr == rep and (cc == c or c == "all") for x in xs]
            speeds.append(sum(x["tokens"] for x in runs) / sum(x["seconds"] for x in runs))
            drafted += sum(x["drafted"] for x in runs)
            accepted += sum(x["accepted"] for x in runs)
        everything[c] = speeds
        print(f"{c:<16} {statistics.median(speeds):7.2f} {min(speeds):6.2f}-{max(speeds):<6.2f} "
              f"{accepted / max(drafted, 1):7.1%}")


def compare(a) -> int:
    speeds: dict[tuple[str, str], list[float]] = defaultdict(list)  # (config, category) -> tok/s per round
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # drafted, accepted
    for path in a.gg:
        runs = json.loads(Path(path).read_text())["runs"]
        for cat in {r["category"] for r in runs} | {"all"}:
            for m in {r["method"] for r in runs}:
                rs = [r["stats"] for r in runs if r["method"] == m and cat in (r["category"], "all")]
                speeds[m, cat].append(sum(x["generated_tokens"] for x in rs) / sum(x["generation_seconds"] for x in rs))
                c = counts[m, cat]
                c[0] += sum(x["drafted"] for x in rs)
                c[1] += sum(x["accepted"] for x in rs)
    names = []
    for spec in a.lcpp:
        name, _, paths = spec.partition("=")
        names.append(name)
        for path in paths.split(","):
            rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
            for cat in {r["category"] for r in rows} | {"all"}:
                rs = [r for r in rows if cat in (r["category"], "all")]
                speeds[name, cat].append(sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs))
                c = counts[name, cat]
                c[0] += sum(r["drafted"] for r in rs)
                c[1] += sum(r["accepted"] for r in rs)
    configs = sorted({k for k, _ in speeds if k not in names}) + names
    cats = sorted({c for _, c in speeds} - {"all"}) + ["all"]
    med = {k: statistics.median(v) for k, v in speeds.items()}
    nan = float("nan")
    print(f"{'category':<15}" + "".join(f"{c:>16}" for c in configs) + f"{'auto/AR':>9}{'auto/llama':>11}")
    for cat in cats:
        cells = []
        for c in configs:
            d, acc = counts[c, cat]
            cells.append(f"{med.get((c, cat), nan):8.2f}" + (f" ({acc / d:4.0%})" if d else " " * 7))
        best = max((med.get((n, cat), nan) for n in names), default=nan)
        auto = med.get(("auto", cat), nan)
        print(f"{cat:<15}" + "".join(f"{x:>16}" for x in cells)
              + f"{auto / med.get(('autoregressive', cat), nan):9.2f}{auto / best:11.2f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-p", "--prompts", action="append", required=True)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("-o", "--output", required=True)
    r = sub.add_parser("run")
    r.add_argument("--bin", required=True)
    r.add_argument("-m", "--model", required=True)
    r.add_argument("-P", "--prompts-file", required=True)
    r.add_argument("-n", type=int, default=64)
    r.add_argument("--repeats", type=int, default=2)
    r.add_argument("-t", "--threads", type=int, default=2)
    r.add_argument("-c", "--ctx", type=int, default=4096)
    r.add_argument("-o", "--output")
    c = sub.add_parser("compare")
    c.add_argument("--gg", action="append", required=True, help="a `ggufspec bench -o` file (one per round)")
    c.add_argument("--lcpp", action="append", default=[], help="NAME=FILE[,FILE...]: a configuration's rounds")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    return {"prompts": make_prompts, "compare": compare}.get(a.cmd, lambda a: run(a, extra))(a)


if __name__ == "__main__":
    sys.exit(main())
