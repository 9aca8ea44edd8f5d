"""What ggufspec spends outside llama.cpp per target pass, on a model that decodes in about a millisecond.

For each method and temperature it generates from HumanEval and Spec-Bench dev prompts and times every pass: the
wall time from one pass's first committed token to the next's, minus both models' llama.cpp decode time (which
ends with llama_synchronize). What is left is Python, numpy, ctypes, logits reads, sampling, acceptance,
detokenizing and bookkeeping: the engine's share. It prints the distribution (p50/p90/p99 in microseconds) and the
share of generation time.

With --parallel N, it runs N slots of an EnginePool instead, N prompts at a time (`stream_many`, 2N prompts a
method and temperature a round; --rounds R rounds, the methods in turn), and reports the engine's share of the pool's
time: the wall time less every tick's decode time (lockstep.Lockstep.decode_seconds), which is the slots' Python
steps between ticks and the last ones' tails. Ratios of methods are steadiest from one process's rounds, and
steadier still at one decode speed (`vs_<first method>_same_decode`: see same_decode_ratios). With --control the
first method also runs a second time each round, as `<method>/control`: its ratio to itself is what that run can
tell apart (on a VM, a few tenths of a percent either way), the yardstick for the others' ratios:

    python scripts/bench_overhead.py --tiny /tmp/ov --parallel 8 --methods autoregressive,auto --temps 0 --rounds 6 \
        --control

With --time-policy it also clocks every slot's policy calls (begin, plan, observe) and reports their time a tick per
method: where a machine's decode times move by more than a method's share of the tick, what one policy costs over
another (`auto`'s over plain batching's, which does nothing) still shows, the clock's own cost counted in both.

With --llama-server, the same model runs in llama.cpp's own loop (its server, one slot, the same thread count and
KV types) at the same temperatures: its time per token against ggufspec's, and against the decode time alone.

    python scripts/bench_overhead.py --tiny /tmp/ov -o overhead.jsonl --llama-server /path/to/llama-server

--tiny DIR writes a random-weight model with SmolLM2's vocabulary (n_embd 64, 2 layers, 2 heads: about 1 ms a decode on
one core) and a noisy copy of it as the draft; or give --target/--draft.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_parallel import emit, free_port, prompts, stop, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_tiny_pair(out: Path) -> tuple[Path, Path]:
    """A ~1 ms-a-decode target with SmolLM2's vocabulary and a noisy copy as its draft (tests' tiny_models)."""
    target, draft = out / "overhead-target.gguf", out / "overhead-draft.gguf"
    if target.exists() and draft.exists():
        return target, draft
    sys.path.insert(0, str(REPO / "tests"))  # the one writer of tiny GGUFs, shared with the test fixtures
    from tiny_models import TinyConfig, noisy_copy, random_weights, read_tokenizer, write_tiny_gguf

    out.mkdir(parents=True, exist_ok=True)
    cfg = TinyConfig(n_head=2, n_head_kv=2, n_ctx=4096)  # heads of 32: the q8_0 K cache (blocks of 32) fits
    fields = read_tokenizer(SMOLLM2)
    weights = random_weights(cfg, 49152, seed=0)
    write_tiny_gguf(target, fields, weights, cfg, "overhead-target")
    write_tiny_gguf(draft, fields, noisy_copy(weights), cfg, "overhead-draft")
    return target, draft


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[round(q * (len(xs) - 1))] if xs else 0.0


def run_ggufspec(engine, prompt: str, method: str, temperature: float, n: int, seed: int) -> tuple[list[float], object, int]:
    """Engine seconds of each pass after the first (the first follows the prefill), the run's stats, and the draft
    model's decodes during the generation."""
    from ggufspec.engine import GenerationSettings
    from ggufspec.sampling import SamplingParams

    s = GenerationSettings(max_tokens=n, method=method, sampling=SamplingParams(temperature), seed=seed)
    t, d = engine.target, engine.draft
    per, passes, t_prev, dec_prev = [], None, None, 0.0
    draft_decodes = d.n_decodes if d is not None else 0
    for r in engine.stream(prompt, s):
        now, dec = time.perf_counter(), t.decode_seconds + (d.decode_seconds if d is not None else 0.0)
        if r.stats.target_passes != passes:
            if t_prev is not None:
                per.append((now - t_prev) - (dec - dec_prev))
            passes, t_prev, dec_prev = r.stats.target_passes, now, dec
    return per, engine.last_result.stats, (d.n_decodes - draft_decodes) if d is not None else 0


def llama_server_row(binary: str, target: Path, draft: Path | None, spec: str, temperature: float, n: int,
                     texts: list[str], threads: int, seed: int, kv: tuple[str, str]) -> dict:
    """llama.cpp's own loop on the same model: ms per generated token (its timings), median over the prompts; `kv`:
    ggufspec's K and V cache types (its V type is this CPU's choice: another would compute other logits)."""
    port = free_port()
    cmd = [binary, "-m", str(target), "--port", str(port), "-c", "4096", "-np", "1", "-t", str(threads),
           "-tb", str(threads), "-fa", "on", "-ctk", kv[0], "-ctv", kv[1], "--no-warmup"]
    if draft is not None:
        cmd += ["-md", str(draft), "-ctkd", kv[0], "-ctvd", kv[1], "-td", str(threads), "-tbd", str(threads)]
    if spec:
        cmd += ["--spec-type", spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc)
        per_token, tps, drafted, accepted = [], [], 0, 0
        for i, text in enumerate([texts[0], *texts]):  # the first is a warm-up
            body = {"prompt": text, "n_predict": n, "temperature": temperature, "top_k": 0, "top_p": 1.0,
                    "min_p": 0.0, "seed": seed + i, "ignore_eos": True, "cache_prompt": False}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                timings = json.loads(r.read())["timings"]
            if i:
                per_token.append(timings["predicted_per_token_ms"])
                tps.append(timings["predicted_per_second"])
                drafted += timings.get("draft_n", 0)
                accepted += timings.get("draft_n_accepted", 0)
        return {"ms_per_token": round(statistics.median(per_token), 4), "tok_s": round(statistics.median(tps), 1),
                "drafted": drafted, "accepted": accepted}
    finally:
        stop(proc)


# a method's round in the pool: tokens, wall seconds, decode seconds, ticks, policy seconds
Round = tuple[int, float, float, int, float]


def pool_share(a: argparse.Namespace, temps: list[float], out) -> None:
    """--parallel: per temperature, 2N prompts through N slots a round, the methods in turn (in reverse every other
    round: a drift of the machine's speed weighs on each alike); per method, the totals over `--rounds` rounds and
    the engine's share of the wall time."""
    from ggufspec.decoder import DecoderOptions
    from ggufspec.engine import GenerationSettings
    from ggufspec.pool import EnginePool
    from ggufspec.sampling import SamplingParams

    n = a.parallel
    texts = prompts(2 * n, start=a.prompts)  # after the warm-up's
    methods = a.methods.split(",")
    if a.control:  # the first method again, under a label of its own (the method is the label's part before "/")
        methods.insert(1, f"{methods[0]}/control")
    clock = {"seconds": 0.0}  # the policies' calls since the last read (--time-policy)
    if a.time_policy:
        time_policies(clock)
    options = DecoderOptions(n_ctx=4096 * n, n_threads=a.threads, n_gpu_layers=a.n_gpu_layers)
    with EnginePool.load(a.target, a.draft, options, parallel=n) as pool:
        lock = pool.lockstep
        for temp in temps:
            settings = {m: GenerationSettings(max_tokens=a.n, method=m.split("/")[0], sampling=SamplingParams(temp),
                                              seed=0) for m in methods}
            rounds: list[dict[str, Round]] = []
            for m in methods:
                for _ in pool.stream_many(prompts(n), settings[m]):  # warm-up (and auto's cost model)
                    pass
            for r in range(a.rounds):
                rounds.append({})
                for m in methods if r % 2 == 0 else methods[::-1]:
                    t0, dec0, ticks0 = time.perf_counter(), lock.decode_seconds, lock.n_ticks
                    clock["seconds"] = 0.0
                    tokens = sum(x.token is not None for _, x in pool.stream_many(texts, settings[m])
                                 if not isinstance(x, Exception))
                    rounds[-1][m] = (tokens, time.perf_counter() - t0, lock.decode_seconds - dec0,
                                     lock.n_ticks - ticks0, clock["seconds"])
            for m in methods:
                tokens, wall, dec, ticks, policy = (sum(col) for col in zip(*(r[m] for r in rounds)))
                same = same_decode_ratios(rounds, methods[0], m)
                emit({"engine": "ggufspec", "parallel": n, "method": m, "temperature": temp, "rounds": a.rounds,
                      "prompts": len(texts), "tokens": tokens, "ticks": ticks, "tok_s": round(tokens / wall, 1),
                      "engine_us_per_tick": round((wall - dec) / ticks * 1e6, 1),
                      **({"policy_us_per_tick": round(policy / ticks * 1e6, 2)} if a.time_policy else {}),
                      "engine_share": round((wall - dec) / wall, 4),
                      **({f"vs_{methods[0]}_same_decode": round(statistics.median(same), 4),
                          "rounds_same_decode": [round(x, 4) for x in sorted(same)]} if same else {})}, out)


def same_decode_ratios(rounds: list[dict[str, Round]], base: str, m: str) -> list[float]:
    """Per round where `m` ran as many ticks as `base` (within 0.5%: the same batches, as `auto` where nothing
    drafts), m's speed over base's had both decoded at one speed (at_one_decode_speed). A VM's speed moves a round's
    decode and engine time alike, by 3-5% from one round to the next (more than a policy's share of a tick); their
    ratio moves far less."""
    if m == base:
        return []
    same = []
    for r in rounds:
        (_, wb, db, tb, _), (_, wm, dm, tm, _) = r[base], r[m]
        if tb and db and dm and abs(tm - tb) <= 0.005 * tb:
            same.append(at_one_decode_speed(wb, db, wm, dm))
    return same


def at_one_decode_speed(wall_base: float, decode_base: float, wall: float, decode: float) -> float:
    """A run's speed over the base run's had both decoded at one speed, where both decoded the same batches:
    (1 + e_base/d_base) / (1 + e/d), e and d each run's engine and decode seconds (1 + e/d = wall / decode)."""
    return (wall_base / decode_base) / (wall / decode)


def time_policies(clock: dict[str, float]) -> None:
    """Add every call of the pool's policies' begin, plan and observe to clock["seconds"] (this process only)."""
    from ggufspec.policy import Fixed
    from ggufspec.policy.auto import AutoPolicy

    def timed(call):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                clock["seconds"] += time.perf_counter() - t0
        return wrapper

    for cls in (Fixed, AutoPolicy):
        for name in ("begin", "plan", "observe"):
            setattr(cls, name, timed(getattr(cls, name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", type=Path, help="write (or reuse) the tiny pair in this folder")
    ap.add_argument("--target", type=Path)
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--methods", default="autoregressive,vanilla,lookup,auto")
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--prompts", type=int, default=6, help="HumanEval and Spec-Bench dev first turns, alternating")
    ap.add_argument("-n", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers on the GPU, both models (-1: all)")
    ap.add_argument("--parallel", type=int, default=0, help="N slots of an EnginePool, N prompts at a time")
    ap.add_argument("--rounds", type=int, default=1, help="--parallel: rounds of 2N prompts, the methods in turn")
    ap.add_argument("--time-policy", action="store_true", help="--parallel: clock the policies' calls too")
    ap.add_argument("--control", action="store_true",
                    help="--parallel: run the first method twice a round, the second as <method>/control")
    ap.add_argument("--llama-server", help="llama-server built from the same llama.cpp source and flags")
    ap.add_argument("-o", "--out", type=Path)
    a = ap.parse_args()
    if a.tiny:
        a.target, a.draft = write_tiny_pair(a.tiny)
    if a.target is None:
        ap.error("give --tiny DIR or --target (and --draft)")
    if a.control and not a.parallel:
        ap.error("--control compares pool rounds: give --parallel N")

    import ggufspec
    from ggufspec.decoder import DecoderOptions
    from ggufspec.engine import SpeculativeEngine

    print(f"ggufspec from {Path(ggufspec.__file__).parent}", file=sys.stderr)

    out = a.out.open("a") if a.out else None
    texts = prompts(a.prompts)
    temps = [float(x) for x in a.temps.split(",")]
    if a.parallel:
        pool_share(a, temps, out)
        if out:
            out.close()
        return
    options = DecoderOptions(n_ctx=4096, n_threads=a.threads, n_gpu_layers=a.n_gpu_layers)
    engine = SpeculativeEngine.load(a.target, a.draft, options)
    engine.answers = None  # every prompt once: no earlier answers to look up, as llama-server has none
    decode_ms: dict[float, float] = {}
    kv = (engine.target.kv_type, engine.target.kv_type_v)
    try:
        for method in a.methods.split(","):
            for temp in temps:
                run_ggufspec(engine, texts[0], method, temp, a.n, 0)  # warm-up (and auto's cost model)
                per, wall, dec, gen, passes, drafted, tgt, decodes = [], 0.0, 0.0, 0, 0, 0, 0.0, 0
                for i, text in enumerate(texts):
                    p, st, d = run_ggufspec(engine, text, method, temp, a.n, i)
                    per += p
                    decodes += d
                    wall += st.generation_seconds
                    dec += st.target_seconds + st.draft_seconds
                    tgt += st.target_seconds
                    gen, passes, drafted = gen + st.generated_tokens, passes + st.target_passes, drafted + st.drafted
                if method == "autoregressive":
                    decode_ms[temp] = tgt / passes * 1e3
                emit({"engine": "ggufspec", "method": method, "temperature": temp, "prompts": len(texts),
                      "tokens": gen, "passes": passes, "drafted_per_pass": round(drafted / passes, 2),
                      "draft_decodes_per_pass": round(decodes / passes, 2),
                      "tok_s": round(gen / wall, 1), "ms_per_token": round(wall / gen * 1e3, 4),
                      "engine_us_p50": round(quantile(per, 0.5) * 1e6, 1),
                      "engine_us_p90": round(quantile(per, 0.9) * 1e6, 1),
                      "engine_us_p99": round(quantile(per, 0.99) * 1e6, 1),
                      "engine_us_mean": round(statistics.fmean(per) * 1e6, 1),
                      "engine_share": round((wall - dec) / wall, 4)}, out)
    finally:
        engine.close()
    if a.llama_server:
        for label, draft, spec in (("none", None, ""), ("draft-simple", a.draft, "draft-simple")):
            for temp in temps:
                row = llama_server_row(a.llama_server, a.target, draft, spec, temp, a.n, texts, a.threads, 0, kv)
                if not spec and temp in decode_ms:  # its loop's time per token beyond ggufspec's measured decode
                    row["overhead_us_vs_decode"] = round((row["ms_per_token"] - decode_ms[temp]) * 1e3, 1)
                emit({"engine": "llama-server", "spec": label, "temperature": temp, **row}, out)
    if out:
        out.close()


if __name__ == "__main__":
    main()
