#!/usr/bin/env python3
"""The GPU check's steps, each timed and stopped at its budget, and the report (docs/gpu.md's content).

Run by scripts/gpu_check.sh, which installs the carried wheels and llama.cpp build first; see docs/gpu.md for the
device call. Steps, in order (each one's process group is killed at its budget, and nothing after the --deadline
starts; the report is rewritten after every step, so a call stopped early still brings back what it measured):

  env        ggufspec doctor, the devices llama.cpp sees, nvidia-smi
  pair       the target made from the carried demo draft (scripts/gpu_pair.py: x--widen wide, x--deepen deep, Q4_0)
  smoke      one short greedy generation on the GPU (a crash here ends the check: every later step would crash too)
  bench      `ggufspec bench`: autoregressive, vanilla, lookup, auto on --bench-prompts prompts
  parallel   scripts/bench_parallel.py against each server (ggufspec serve -np N, and llama-server -np N where
             --llama-server names a binary: its user's build, as this repository builds none of llama.cpp's tools)
  textcheck  greedy texts: bench's methods against autoregressive, every server against the first; each divergence
             classified by the target's top-2 logit gap where the texts part (near-tie: under --near-tie)
  overhead   scripts/bench_overhead.py --parallel N on the pair (only if the time left allows)

    python scripts/gpu_check.py --out DIR --payload .gpu [--llama-server PATH] [options]
    python scripts/gpu_check.py textcheck ...   (the textcheck step's child; needs llama.cpp)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
DRAFT = REPO / "models" / "demo" / "smollm2-135m-draft.Q8_0.gguf"
REPORT_RESERVE = 10.0  # seconds kept for the last report


class Check:
    """The steps' shared state: options, paths, the clock, what each step measured."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.t0 = a, time.monotonic()
        self.out, self.work = Path(a.out), Path(a.work)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.target = self.work / f"target-x{a.widen}w-x{a.deepen}d.Q4_0.gguf"
        self.draft = self.work / f"draft-noise{a.draft_noise}.Q8_0.gguf" if a.draft_noise else DRAFT
        self.steps: list[dict] = []
        self.results: dict = {"options": {k: v for k, v in vars(a).items() if k != "func"}}
        self.log = open(self.out / "log.txt", "a", encoding="utf-8")
        self.py = sys.executable
        for name in ("bench.txt", "textcheck.json", "overhead.txt", "overhead.jsonl"):  # an earlier call's, if any
            (self.work / name).unlink(missing_ok=True)

    def left(self) -> float:
        return self.a.deadline - (time.monotonic() - self.t0)

    def say(self, msg: str) -> None:
        line = f"[gpu_check {time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, name: str, cmd: list[str], budget: float, stdout: Path | None = None) -> dict:
        """Run one command in its own process group, its output appended to log.txt (and to `stdout`), for at most
        `budget` seconds or what is left before the deadline; its record (seconds, status) goes in self.steps."""
        limit = min(budget, self.left() - REPORT_RESERVE)
        rec = {"step": name, "budget_s": round(budget), "command": shlex.join(cmd)}
        if limit < 5:
            rec.update(status="skipped: no time left", seconds=0.0)
            self.steps.append(rec)
            self.say(f"{name}: skipped, {self.left():.0f} s left")
            return rec
        self.say(f"{name}: start (budget {limit:.0f} s): {rec['command']}")
        t = time.monotonic()
        sink = open(stdout, "w", encoding="utf-8") if stdout else subprocess.PIPE
        p = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.PIPE if stdout else subprocess.STDOUT,
                             text=True, start_new_session=True, env=self.env())
        try:
            out, err = p.communicate(timeout=limit)
            rec["status"] = "ok" if p.returncode == 0 else f"failed (exit {p.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            try:
                out, err = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a pipe held by a process outside the group: leave its output
                out, err = "", ""
            rec["status"] = f"stopped at its budget ({limit:.0f} s)"
        finally:
            if stdout:
                sink.close()
        text = (out or "") + (err or "")
        if stdout:
            text = stdout.read_text(encoding="utf-8", errors="replace") + (err or "")
        self.log.write(text[-20000:] + "\n")
        rec["seconds"] = round(time.monotonic() - t, 1)
        rec["tail"] = text[-1500:]
        self.steps.append(rec)
        self.say(f"{name}: {rec['status']} in {rec['seconds']} s")
        self.report()
        return rec

    def env(self) -> dict:
        e = dict(os.environ, PYTHONUNBUFFERED="1", GGUFSPEC_CACHE=str(self.work / "cache"))
        e["GGUFSPEC_BENCH_DIR"] = str(Path(self.a.payload) / "bench")
        return e

    def report(self) -> None:
        self.results["steps"] = self.steps
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))
        try:
            text = render(self)
        except Exception as e:  # the measurements are in results.json: a report that cannot be drawn loses none
            text = f"the report failed ({e!r}); results.json holds every measurement\n"
        (self.out / "gpu.md").write_text(text)


# --- steps ---------------------------------------------------------------------------------------------------------

def step_env(c: Check) -> bool:
    rec = c.run("env", [c.py, "-m", "ggufspec.cli", "doctor"], 90)
    c.run("devices", [c.py, __file__, "devices"], 60)
    smi = c.run("nvidia-smi", ["bash", "-c", "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,"
                               "clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 || echo 'no nvidia-smi'"], 30)
    c.results["machine"] = {"doctor": rec.get("tail", ""), "nvidia_smi": smi.get("tail", ""),
                            "devices": c.steps[-2].get("tail", "")}
    return rec["status"] == "ok"


def step_pair(c: Check) -> bool:
    if c.target.exists() and c.draft.exists():
        c.say(f"pair: {c.target} and {c.draft} exist, kept")
        rec = {"step": "pair", "status": "ok", "seconds": 0.0, "budget_s": 0, "tail": "kept from an earlier call"}
        c.steps.append(rec)
    else:
        noisy = ["--draft-out", str(c.draft), "--noise", str(c.a.draft_noise)] if c.a.draft_noise else []
        rec = c.run("pair", [c.py, str(SCRIPTS / "gpu_pair.py"), str(DRAFT), str(c.target), "--widen", str(c.a.widen),
                             "--deepen", str(c.a.deepen), "--tools", str(Path(c.a.payload)), *noisy], c.a.budget_pair)
    if c.target.exists() and c.draft.exists():
        c.results["pair"] = {"target": c.target.name, "target_bytes": c.target.stat().st_size,
                             "draft": c.draft.name, "draft_bytes": c.draft.stat().st_size}
    return rec["status"] == "ok"


def gg_options(c: Check) -> list[str]:
    return ["-ngl", str(c.a.ngl)] + (["-t", str(c.a.threads)] if c.a.threads else [])


def step_smoke(c: Check) -> bool:
    rec = c.run("smoke", [c.py, "-m", "ggufspec.cli", "generate", "-m", str(c.target), "-d", str(c.draft), "-n", "32",
                          "--temp", "0", "--stats", *gg_options(c), "def fibonacci(n):"], 90)
    return rec["status"] == "ok"


def step_bench(c: Check) -> bool:
    methods = [x for m in c.a.methods.split(",") for x in ("--method", m)]
    rec = c.run("bench", [c.py, "-m", "ggufspec.cli", "bench", "-m", str(c.target), "-d", str(c.draft),
                          "-p", str(Path(c.a.payload) / "prompts.jsonl"), "--limit", str(c.a.bench_prompts),
                          *methods, "-n", str(c.a.max_tokens), "--repeats", str(c.a.bench_repeats),
                          "--warmup", str(c.a.bench_warmup), "-c", "4096", *gg_options(c),
                          "-o", str(c.out / "bench.json")], c.a.budget_bench, stdout=c.work / "bench.txt")
    if (c.work / "bench.txt").exists():
        c.results["bench_table"] = (c.work / "bench.txt").read_text()
    return rec["status"] == "ok"


def servers(c: Check) -> dict[str, str]:
    a, t, d = c.a, shlex.quote(str(c.target)), shlex.quote(str(c.draft))
    gg = (f"{c.py} -m ggufspec.cli serve -m {t} -d {d} --port {{port}} -np {a.np} -c {a.ctx} "
          + shlex.join(gg_options(c)))
    ls = (f"{a.llama_server} -m {t} --port {{port}} -np {a.np} -c {a.ctx} -ngl {a.ls_ngl}"
          + (f" -t {a.threads}" if a.threads else ""))
    every = {"gg-auto": gg, "gg-off": gg + " --method autoregressive", "ls-none": ls,
             "ls-draft": ls + f" -md {d} -ngld {a.ls_ngl} --spec-type draft-simple",
             "ls-ngram": ls + " --spec-type ngram-mod",
             "gg-serial": gg.replace(f"-np {a.np} -c {a.ctx}", f"-np 1 -c {a.ctx // a.np}")}
    return {name: every[name] for name in a.servers.split(",")}


def step_parallel(c: Check) -> bool:
    ok = True
    for name, command in servers(c).items():
        if name.startswith("ls-") and not os.access(c.a.llama_server, os.X_OK):
            c.say(f"parallel {name}: skipped, no llama-server binary given (--llama-server {c.a.llama_server!r})")
            c.steps.append({"step": f"parallel {name}", "status": "skipped: no llama-server given", "seconds": 0.0,
                            "budget_s": 0})
            continue
        rec = c.run(f"parallel {name}", [c.py, str(SCRIPTS / "bench_parallel.py"), "--server", f"{name}={command}",
                                         "--clients", c.a.clients, "--requests-per-client", str(c.a.requests),
                                         "-n", str(c.a.max_tokens), "-o", str(c.out / "parallel.jsonl")],
                    c.a.budget_server)
        ok &= rec["status"] == "ok"
    return ok


def step_textcheck(c: Check) -> bool:
    rec = c.run("textcheck", [c.py, __file__, "textcheck", "--target", str(c.target), "--ngl", str(c.a.ngl),
                              "--bench", str(c.out / "bench.json"), "--prompts", str(Path(c.a.payload) / "prompts.jsonl"),
                              "--parallel", str(c.out / "parallel.jsonl"), "--near-tie", str(c.a.near_tie),
                              "--max-seconds", str(max(5.0, min(c.a.budget_textcheck, c.left()) - 20)),
                              "-o", str(c.work / "textcheck.json")], c.a.budget_textcheck)
    if (c.work / "textcheck.json").exists():
        c.results["textcheck"] = json.loads((c.work / "textcheck.json").read_text())
    return rec["status"] == "ok"


def step_overhead(c: Check) -> bool:
    if c.left() < c.a.budget_overhead + REPORT_RESERVE:
        c.say(f"overhead: skipped ({c.left():.0f} s left, its budget is {c.a.budget_overhead} s)")
        c.steps.append({"step": "overhead", "status": "skipped: no time left", "seconds": 0.0,
                        "budget_s": round(c.a.budget_overhead)})
        return True
    out = c.work / "overhead.jsonl"
    rec = c.run("overhead", [c.py, str(SCRIPTS / "bench_overhead.py"), "--target", str(c.target), "--draft", str(c.draft),
                             "-ngl", str(c.a.ngl), "--parallel", str(c.a.np), "--temps", "0", "--prompts",
                             str(c.a.np * 2), "-n", str(c.a.max_tokens), "--threads", str(c.a.threads or 4),
                             "-o", str(out)], c.a.budget_overhead, stdout=c.work / "overhead.txt")
    if (c.work / "overhead.txt").exists():
        c.results["overhead"] = (c.work / "overhead.txt").read_text()[-4000:]
    return rec["status"] == "ok"


STEPS = {"env": step_env, "pair": step_pair, "smoke": step_smoke, "bench": step_bench, "parallel": step_parallel,
         "textcheck": step_textcheck, "overhead": step_overhead}
NEEDED = {"env", "pair", "smoke"}  # later steps cannot run without these


def check(a: argparse.Namespace) -> int:
    c = Check(a)
    c.say(f"repo {REPO}, out {c.out}, work {c.work}, deadline {a.deadline:.0f} s, python {sys.version.split()[0]}")
    failed = False
    for name in a.steps.split(","):
        if not STEPS[name](c) and name in NEEDED:
            c.say(f"{name} failed: the steps after it need it, so the check ends here")
            failed = True
            break
    c.results["total_s"] = round(time.monotonic() - c.t0, 1)
    c.report()
    c.say(f"done in {c.results['total_s']} s; report: {c.out / 'gpu.md'}")
    print((c.out / "gpu.md").read_text())
    return 1 if failed else 0


# --- the report ----------------------------------------------------------------------------------------------------

def parallel_rows(c: Check) -> list[dict]:
    path = c.out / "parallel.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def parallel_table(rows: list[dict]) -> list[str]:
    levels = sorted({r["clients"] for r in rows})
    names = list(dict.fromkeys(r["server"] for r in rows))
    cell = {(r["server"], r["clients"]): r for r in rows}
    out = ["aggregate tok/s (time to first token p50/p95 s, per-request tok/s median)", "",
           "| server | " + " | ".join(f"{n} client{'s' * (n > 1)}" for n in levels) + " |",
           "|---|" + "---|" * len(levels)]
    for s in names:
        cells = [cell.get((s, n)) for n in levels]
        out.append(f"| {s} | " + " | ".join(
            f"{r['tok_s']:.1f} ({r['ttft_p50']:.2f}/{r['ttft_p95']:.2f}, {r['req_tok_s_median']:.1f})" if r else "-"
            for r in cells) + " |")
    ls = [s for s in names if s.startswith("ls-")]
    for n in levels:
        best = max((cell[(s, n)]["tok_s"] for s in ls if (s, n) in cell), default=None)
        auto, off = cell.get(("gg-auto", n)), cell.get(("gg-off", n))
        ratios = []
        if auto and best:
            ratios.append(f"gg-auto/best llama-server {auto['tok_s'] / best:.2f}")
        if auto and off:
            ratios.append(f"gg-auto/gg-off {auto['tok_s'] / off['tok_s']:.2f}")
        if ratios:
            out.append(f"- {n} client{'s' * (n > 1)}: " + "; ".join(ratios))
    return out


def textcheck_lines(tc: dict) -> list[str]:
    out = [f"Near-tie: the target's top-2 logit gap where the texts part is under {tc['near_tie']} (decoded one token "
           "at a time on this machine). Reference: bench's autoregressive run of the same prompt and repetition; for the "
           f"servers, {tc.get('parallel_reference') or '-'} on the same request.", "",
           "| compared | equal | diverged: near-tie | diverged: not a near-tie | length only | not classified (time) |",
           "|---|---|---|---|---|---|"]
    for k, v in tc["summary"].items():
        out.append(f"| {k} | {v['equal']}/{v['total']} | {v['near_tie']} | {v['not_near_tie']} | {v['length']} "
                   f"| {v.get('unclassified', 0)} |")
    bad = [d for d in tc["divergences"] if d["class"] == "not a near-tie"]
    for d in bad[:12]:
        out.append(f"- not a near-tie: {d['what']} at token {d['token']}: gap {d['gap']:.3f} "
                   f"({d['pieces'][0]!r} vs {d['pieces'][1]!r})")
    return out


def render(c: Check) -> str:
    a, r = c.a, c.results
    lines = [f"## Run of {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC ({a.label})", "",
             f"Pair: target `{c.target.name}` (the demo draft x{a.widen} wide, x{a.deepen} deep, Q4_0"
             + (f", {r['pair']['target_bytes'] / 1e9:.2f} GB" if "pair" in r else "") + "), draft `"
             + c.draft.name + f"`. ggufspec `-ngl {a.ngl}`, "
             + (f"llama-server `-ngl {a.ls_ngl}`" if a.llama_server else "no llama-server given")
             + f"; `-np {a.np} -c {a.ctx}`; {a.max_tokens} tokens an answer, greedy.", ""]
    machine = r.get("machine", {})
    if machine:
        lines += ["Machine:", "", "```", machine.get("nvidia_smi", "").strip(), machine.get("devices", "").strip(),
                  "\n".join(machine.get("doctor", "").strip().splitlines()[:6]), "```", ""]
    manifest = Path(a.payload) / "MANIFEST.txt"
    if manifest.exists():
        kept = [x for x in manifest.read_text().splitlines() if "./whl/" not in x and "./bench/" not in x]
        lines += ["Build (the carried payload's MANIFEST.txt, wheels left out):", "", "```", *kept, "```", ""]
    lines += ["Steps:", "", "| step | status | seconds | budget s |", "|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['budget_s']} |" for s in c.steps]
    lines += ["", f"Total {time.monotonic() - c.t0:.0f} s of a {a.deadline:.0f} s deadline.", ""]
    if r.get("bench_table"):
        lines += ["### `ggufspec bench`", "", "```", r["bench_table"].strip(), "```", ""]
    rows = parallel_rows(c)
    if rows:
        lines += [f"### `bench_parallel.py --clients {a.clients} --requests-per-client {a.requests}`", ""]
        lines += parallel_table(rows) + [""]
    if r.get("textcheck"):
        lines += ["### Greedy texts", ""] + textcheck_lines(r["textcheck"]) + [""]
    if r.get("overhead"):
        lines += ["### `bench_overhead.py`", "", "```", r["overhead"].strip(), "```", ""]
    failed = [s for s in c.steps if s["status"] != "ok" and not s["status"].startswith("skipped")]
    for s in failed:
        lines += [f"`{s['step']}` {s['status']}; its output ended:", "", "```", s.get("tail", "").strip()[-800:],
                  "```", ""]
    return "\n".join(lines)


# --- textcheck (a child process: loads the target with llama.cpp) --------------------------------------------------

def parting(engine, decoder, prompt, texts: list[str]) -> tuple[int, float, list]:
    """Where two greedy continuations of `prompt` part, walking the target's own tokens (one at a time) along their
    common text: (token index, the target's top-2 logit gap there, the two pieces that differ)."""
    import numpy as np

    vocab, blobs = decoder.vocab, [t.encode() for t in texts]
    logits = decoder.sync(engine.encode(prompt))[-1]
    for i in range(4 * max(len(b) for b in blobs) + 8):
        ranked = np.argsort(logits)[::-1][:200]
        pieces = [(int(t), vocab.piece(int(t))) for t in ranked]
        picks = [next((t for t, p in pieces if p and b.startswith(p)), None) for b in blobs]
        if picks[0] != picks[1] or picks[0] is None:
            top2 = np.sort(logits)[-2:]
            return i, float(top2[1] - top2[0]), [vocab.piece(t) if t is not None else None for t in picks]
        step = len(vocab.piece(picks[0]))
        blobs = [b[step:] for b in blobs]
        logits = decoder.feed([picks[0]])[-1]
    return -1, float("nan"), [None, None]


def compare(engine, what: str, prompt, ref: str, got: str, near_tie: float, tally: dict, found: list,
            until: float) -> None:
    t = tally.setdefault(what.split(" #")[0], {"total": 0, "equal": 0, "near_tie": 0, "not_near_tie": 0, "length": 0,
                                               "unclassified": 0})
    t["total"] += 1
    if got == ref:
        t["equal"] += 1
        return
    if ref.startswith(got) or got.startswith(ref):
        t["length"] += 1
        found.append({"what": what, "class": "length only", "token": None, "gap": None, "pieces": [None, None]})
        return
    if time.monotonic() > until:  # out of the step's time: counted, not classified
        t["unclassified"] += 1
        found.append({"what": what, "class": "unclassified", "token": None, "gap": None, "pieces": [None, None]})
        return
    i, gap, pieces = parting(engine, engine.target, prompt, [ref, got])
    cls = "near-tie" if gap < near_tie else "not a near-tie"
    t["near_tie" if cls == "near-tie" else "not_near_tie"] += 1
    found.append({"what": what, "class": cls, "token": i, "gap": gap,
                  "pieces": [p.decode(errors="replace") if p else None for p in pieces]})


def textcheck(a: argparse.Namespace) -> int:
    sys.path.insert(0, str(SCRIPTS))
    import ggufspec  # noqa: F401  (llama.cpp first)
    from bench_parallel import prompts as parallel_prompts
    from ggufspec.bench import load_prompts
    from ggufspec.decoder import DecoderOptions
    from ggufspec.engine import SpeculativeEngine

    until = time.monotonic() + a.max_seconds
    engine = SpeculativeEngine.load(a.target, None, DecoderOptions(n_ctx=4096, n_gpu_layers=a.ngl))
    tally: dict = {}
    found: list = []
    res = {"near_tie": a.near_tie, "summary": tally, "divergences": found}
    if a.bench and Path(a.bench).exists():
        bench = json.loads(Path(a.bench).read_text())
        by_id = {p.id: p.prompt for p in load_prompts(a.prompts)}
        ref = {(x["prompt"], x["repeat"]): x for x in bench["runs"] if x["method"] == "autoregressive"}
        piece = engine.target.vocab.piece
        for x in bench["runs"]:
            base = ref.get((x["prompt"], x["repeat"]))
            if x["method"] == "autoregressive" or base is None or x["temperature"] != 0:
                continue
            text = [b"".join(piece(t) for t in y["tokens"]).decode(errors="replace") for y in (base, x)]
            compare(engine, f"bench {x['method']} #{x['prompt']}/{x['repeat']}", by_id[x["prompt"]], *text,
                    a.near_tie, tally, found, until)
    if a.parallel and Path(a.parallel).exists():
        rows = [json.loads(x) for x in Path(a.parallel).read_text().splitlines() if x.strip()]
        first = rows[0]["server"] if rows else None
        res["parallel_reference"] = first
        starts, at = {}, 0
        for r in rows:  # bench_parallel's prompt offsets: each client count's requests follow the last one's
            if r["server"] == first:
                starts[r["clients"]] = at
                at += r["requests"]
        refs = {r["clients"]: r["texts"] for r in rows if r["server"] == first}
        for r in rows:
            if r["server"] == first or r["clients"] not in refs or r["temperature"] != 0:
                continue
            ps = parallel_prompts(r["requests"], starts[r["clients"]])
            for j, (want, got) in enumerate(zip(refs[r["clients"]], r["texts"])):
                compare(engine, f"{r['server']} vs {first} at {r['clients']} client{'s' * (r['clients'] > 1)} #{j}", ps[j], want, got,
                        a.near_tie, tally, found, until)
    engine.close()
    Path(a.output).write_text(json.dumps(res, indent=1))
    for k, v in tally.items():
        print(k, v)
    return 0


def devices() -> int:
    """The devices llama.cpp registered, with their memory (the devices step's child)."""
    import ctypes

    import ggufspec  # noqa: F401  (llama.cpp first)
    from ggufspec.ggml_api import devices as registered, ggml

    g = ggml()
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(g, name).restype, getattr(g, name).argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    g.ggml_backend_dev_memory.restype = None
    g.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.POINTER(ctypes.c_size_t)]
    for d in registered():
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        g.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        print(f"device {g.ggml_backend_dev_name(d).decode()}: {g.ggml_backend_dev_description(d).decode()}, "
              f"{free.value / 2**30:.1f} of {total.value / 2**30:.1f} GiB free")
    return 0


def main() -> int:
    if sys.argv[1:2] == ["devices"]:
        return devices()
    if sys.argv[1:2] == ["textcheck"]:
        t = argparse.ArgumentParser(prog="gpu_check.py textcheck", allow_abbrev=False)
        t.add_argument("--target", required=True)
        t.add_argument("--ngl", type=int, default=-1)
        t.add_argument("--bench", default="")
        t.add_argument("--prompts", default="")
        t.add_argument("--parallel", default="")
        t.add_argument("--near-tie", type=float, default=0.25)
        t.add_argument("-o", "--output", required=True)
        t.add_argument("--max-seconds", type=float, default=1e9, help="divergences found later are not classified")
        return textcheck(t.parse_args(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    g = ap.add_argument_group("check")
    g.add_argument("--out", default=os.environ.get("OUT") or str(REPO / ".gpu-out"))
    g.add_argument("--work", default="/tmp/gpucheck", help="models, caches and logs that do not come back")
    g.add_argument("--payload", default=str(REPO / ".gpu"), help="prompts, widen_gguf.py, MANIFEST.txt")
    g.add_argument("--llama-server", default="",
                   help="a llama-server binary of the same llama.cpp (its user's build): the servers ls-* run on it, "
                        "and are skipped without one")
    g.add_argument("--label", default="GPU")
    g.add_argument("--steps", default="env,pair,smoke,bench,parallel,textcheck,overhead")
    g.add_argument("--deadline", type=float, default=300, help="seconds: no step starts past it")
    g.add_argument("--ngl", type=int, default=-1, help="ggufspec's -ngl (-1: every layer)")
    g.add_argument("--ls-ngl", type=int, default=99, help="llama-server's -ngl and -ngld")
    g.add_argument("--threads", type=int, default=0, help="-t for both (0: their defaults)")
    g.add_argument("--widen", type=int, default=8)
    g.add_argument("--deepen", type=int, default=5)
    g.add_argument("--draft-noise", type=float, default=0.0,
                   help="draft: the demo draft plus this much noise (0: the demo draft itself; scripts/gpu_pair.py)")
    g.add_argument("--methods", default="autoregressive,vanilla,lookup,auto")
    g.add_argument("--bench-prompts", type=int, default=8)
    g.add_argument("--bench-repeats", type=int, default=2)
    g.add_argument("--bench-warmup", type=int, default=1)
    g.add_argument("-n", "--max-tokens", type=int, default=128)
    g.add_argument("--servers", default="ls-none,gg-auto,gg-off,ls-draft,ls-ngram",
                   help="in this order; the first is the texts' reference (also: gg-serial, ggufspec -np 1)")
    g.add_argument("--clients", default="1,2,4")
    g.add_argument("--requests", type=int, default=2, help="requests per client")
    g.add_argument("--np", type=int, default=4, help="server slots")
    g.add_argument("--ctx", type=int, default=8192, help="server context, all slots")
    g.add_argument("--near-tie", type=float, default=0.25, help="top-2 logit gap under which a divergence is a near-tie")
    g.add_argument("--budget-pair", type=float, default=150)
    g.add_argument("--budget-bench", type=float, default=100)
    g.add_argument("--budget-server", type=float, default=45, help="per server in the parallel step")
    g.add_argument("--budget-textcheck", type=float, default=45)
    g.add_argument("--budget-overhead", type=float, default=45)
    return check(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
