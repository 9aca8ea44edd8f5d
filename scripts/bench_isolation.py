"""What a decoder in a child process (isolated.py, as a target on RPC servers runs) costs per pass: the same model
fed the same tokens here and in a DecoderProcess, alternating, one token and a 5-token verification batch per pass.
Prints the median seconds per pass of each, and the difference.

    python scripts/bench_isolation.py -m .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --passes 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ggufspec.decoder import DecoderOptions, LlamaCppDecoder
from ggufspec.isolated import DecoderProcess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--passes", type=int, default=200)
    a = ap.parse_args()
    options = DecoderOptions(n_ctx=2048)
    process = DecoderProcess(timeout=60)
    there = process.open(a.model, options)
    with LlamaCppDecoder(a.model, options) as here:
        prompt = here.vocab.encode("Once upon a time, in a land far away,", add_special=True)
        times: dict[str, list[float]] = {f"{where} {k}": [] for k in (1, 5) for where in ("here", "child")}
        for d in (here, there):
            d.feed(prompt)
        for i in range(a.passes):
            for k in (1, 5):
                for where, d in (("here", here), ("child", there)) if i % 2 == 0 else (("child", there), ("here", here)):
                    start = time.perf_counter()
                    d.feed(prompt[1:1 + k])  # a verification batch: logits of every row
                    times[f"{where} {k}"].append(time.perf_counter() - start)
                    d.rollback_to(len(prompt))
    there.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    for k in (1, 5):
        print(json.dumps({"tokens": k, "here_ms": round(medians[f"here {k}"] * 1e3, 3),
                          "child_ms": round(medians[f"child {k}"] * 1e3, 3),
                          "extra_ms": round((medians[f"child {k}"] - medians[f"here {k}"]) * 1e3, 3)}))


if __name__ == "__main__":
    main()
