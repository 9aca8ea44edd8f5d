"""Distillation data for the demo draft: the target's own greedy text and its top-k logits at every position.

Recipe step 1 of 2 (step 2: draft_train.py). Prompts are made here, never taken from the benchmark sets:
templated instructions over many topics, user turns the target itself samples, summarisation/QA/translation
over local text (Python's own docstrings), and HumanEval-style completions of standard-library functions.
Generation is continuous-batched greedy decoding on llama.cpp's low-level API (many sequences per pass).

    nice -n 19 python scripts/recipes/draft_data.py TARGET.gguf OUT.npz --minutes 20 --seed 0
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import importlib
import inspect
import pkgutil
import random
import sys
import textwrap
import time
from pathlib import Path

import llama_cpp
import numpy as np

from ggufspec.chat import render_chat
from ggufspec.decoder import DecoderOptions, LlamaCppDecoder

TOP_K = 16

TOPICS = """the water cycle; black holes; the French Revolution; photosynthesis; machine learning; the Roman Empire;
climate change; the human immune system; renewable energy; jazz music; the stock market; volcanoes; coffee;
the printing press; quantum computing; honeybees; the Silk Road; democracy; vaccines; the Moon landing;
plate tectonics; inflation; social media; the Renaissance; electric cars; sleep; the internet; chess; rainforests;
ancient Egypt; the theory of evolution; nuclear power; remote work; the Olympic Games; antibiotics; recycling;
artificial intelligence ethics; the Great Wall of China; dinosaurs; ocean tides; supply and demand; meditation;
the Industrial Revolution; DNA; cryptocurrency; Shakespeare; the solar system; urban gardening; public libraries;
volunteering; time management; the Cold War; mountains; friendship; bread baking; marathon training; gravity;
the periodic table; hurricanes; smartphones; the history of writing; languages; museums; electricity; bicycles""".replace("\n", " ")

TASKS = [
    "Explain {t} to a high school student.", "Write a short essay about {t}.", "What are the main causes and effects of {t}?",
    "Give me five interesting facts about {t}.", "Write a blog post about {t}.", "Summarize the history of {t} in a paragraph.",
    "What are the pros and cons of {t}?", "Write a poem about {t}.", "Describe {t} in simple terms.",
    "Write a persuasive paragraph arguing that {t} matters.", "Pretend you are a tour guide and talk about {t}.",
    "Create an outline for a presentation on {t}.", "What questions do scientists still have about {t}?",
    "Write a short story that involves {t}.", "How would you teach a child about {t}?", "Compare {t} and {u}.",
    "Imagine you are a famous explorer. Describe your encounter with {t}.", "Write a product description related to {t}.",
    "List the key terms someone should know about {t} and define each.", "Write an email to a friend about {t}.",
]
MATH = [
    "What is {a} + {b}?", "What is {a} times {b}?", "If a shirt costs ${a} and is discounted by {p}%, what is the new price?",
    "Solve for x: {a}x + {b} = {c}.", "A train travels {a} miles in {b} hours. What is its average speed?",
    "Tom has {a} apples. He gives {b} to his friend and buys {c} more. How many apples does he have now?",
    "What is the area of a rectangle with sides {a} and {b}?", "Is {a} a prime number? Explain.",
    "A store sells pencils at {b} cents each. How much do {a} pencils cost in dollars?",
    "Sarah saves ${b} every week. How many weeks does she need to save ${c}?", "What is {p}% of {c}?",
    "The sum of two numbers is {c} and their difference is {b}. What are the numbers?",
]
CODE = [
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.", "How do I {c} in Python?",
    "Write a C function that {c}.", "Explain how to write a program that {c}.",
]
CODE_TASKS = """reverses a string; checks if a number is prime; computes the factorial of n; sorts a list of numbers;
finds the largest element in a list; counts the vowels in a string; merges two sorted lists; computes Fibonacci numbers;
removes duplicates from a list; checks whether a string is a palindrome; reads a file and counts its lines;
converts Celsius to Fahrenheit; finds the common elements of two lists; returns the n-th triangular number;
flattens a nested list; computes the greatest common divisor of two numbers; parses a CSV line;
implements binary search; counts word frequencies in a text; validates an email address""".replace("\n", " ")
LANGS = ["French", "German", "Spanish", "Italian", "Chinese", "Japanese"]
QA = [
    "What is {t}?", "Who first studied {t}?", "When did people start to understand {t}?", "Why is {t} important?",
    "Where can I learn more about {t}?", "What is the most surprising thing about {t}?", "How does {t} work?",
    "What is one common misconception about {t}?",
]
PERSONAS = """a pirate captain; Sherlock Holmes; a medieval knight; Albert Einstein; Marie Curie; a friendly robot;
a famous chef; a space explorer on Mars; a wise old wizard; a sports coach; a detective from the 1920s;
Leonardo da Vinci; a startup founder; a museum guide; a kindergarten teacher; a travel blogger""".replace("\n", " ")
ROLEPLAY = [
    "Pretend yourself to be {p} in all the following conversations. Speak like {p} as much as possible. What do you think of {t}?",
    "Act as {p}. Tell me about your day and how {t} was part of it.", "Imagine you are {p}. Give me advice about {t}.",
]
# Follow-ups: the target's own answers to these become the input of a second prompt, so summaries,
# passages with questions, and German-to-English translation have text to work on without any corpus.
ARTICLE = ["Write a news article about {t}.", "Write a detailed report on recent developments in {t}."]
GERMAN = "Translate the following sentence into German: {s}"
FOLLOW_UPS = {
    "article": ["Summarize: {x}", "{x}\n\nBased on the passage above, what is the main point?",
                "Read the passage and answer the question.\n\nPassage: {x}\n\nQuestion: Who or what is it about?"],
    "german": ["Translate German to English: {x}"],
}

def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(";") if x.strip()]


def local_docs(rng: random.Random, n: int) -> list[str]:
    """Paragraph-sized plain English from the docstrings of installed standard-library modules."""
    docs: list[str] = []
    for m in sorted(sys.stdlib_module_names):
        if m.startswith("_") or m in ("antigravity", "this", "idlelib", "tkinter", "turtledemo"):
            continue
        try:
            mod = importlib.import_module(m)
        except Exception:
            continue
        for obj in [mod] + [getattr(mod, a, None) for a in dir(mod)[:40]]:
            doc = inspect.getdoc(obj) if obj is not None else None
            if doc and 300 < len(doc) < 2500 and doc.count("\n\n") < 12 and ">>>" not in doc:
                docs.append(doc)
    docs = sorted(set(docs))
    rng.shuffle(docs)
    return docs[:n]


def code_prompts(rng: random.Random, n: int) -> list[str]:
    """HumanEval-style prompts: a standard-library function's signature and docstring, body left to complete."""
    out: list[str] = []
    for info in pkgutil.iter_modules([str(Path(inspect.getfile(argparse)).parent)]):
        path = Path(inspect.getfile(argparse)).parent / f"{info.name}.py"
        if info.name.startswith("_") or not path.exists():
            continue
        try:
            src = path.read_text()
            tree = ast.parse(src)
        except Exception:
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.col_offset == 0 and ast.get_docstring(node):
                doc = node.body[0]
                head = "\n".join(lines[node.lineno - 1 : doc.end_lineno])
                if 80 < len(head) < 1200:
                    out.append(head + "\n")
    out = sorted(set(out))
    rng.shuffle(out)
    return out[:n]


def make_prompts(rng: random.Random, template: str, docs: list[str], per_topic: int = 6,
                 n_math: int = 150) -> list[tuple[str, str]]:
    """(kind, text) pairs; chat prompts are rendered with the target's template, code completions stay plain.
    Kinds "article" and "german" get follow-up prompts made from their answers (FOLLOW_UPS)."""
    topics = _split(TOPICS)
    chats: list[str] = []
    kinds: list[str] = []
    for t in topics:
        for task in rng.sample(TASKS, min(per_topic, len(TASKS))):
            chats.append(task.format(t=t, u=rng.choice(topics)))
        for task in rng.sample(QA, min(per_topic // 2, len(QA))):
            chats.append(task.format(t=t))
        chats.append(rng.choice(ROLEPLAY).format(p=rng.choice(_split(PERSONAS)), t=t))
    kinds += ["chat"] * len(chats)
    for t in topics:
        for task in ARTICLE:
            chats.append(task.format(t=t))
            kinds.append("article")
    for _ in range(n_math):
        a, b, c, p = rng.randint(2, 99), rng.randint(2, 60), rng.randint(60, 500), rng.choice([10, 15, 20, 25, 30, 40, 50])
        chats.append(rng.choice(MATH).format(a=a, b=b, c=c, p=p))
        kinds.append("chat")
    for c in _split(CODE_TASKS):
        for task in rng.sample(CODE, 3):
            chats.append(task.format(c=c))
            kinds.append("chat")
    for d in docs:
        first = d.split("\n\n")[0].replace("\n", " ")
        sent = first.split(". ")[0][:200]
        kind, r = "chat", rng.random()
        if r < 0.25:
            chats.append(f"Summarize the following text:\n\n{d}")
        elif r < 0.4:
            chats.append(f"{d}\n\nBased on the text above, what is the main purpose described?")
        elif r < 0.5:
            chats.append(f"Translate the following sentence into {rng.choice(LANGS)}: {sent}")
        elif r < 0.65:
            chats.append(GERMAN.format(s=sent))
            kind = "german"
        elif r < 0.8:
            chats.append(f"Extract the key terms from the following text and give a one-line definition of each:\n\n{d}")
        else:
            chats.append(f"Read the passage and answer the question.\n\nPassage: {d}\n\nQuestion: What does this describe, and how is it used?")
        kinds.append(kind)
    return [(k, render_chat(template, [{"role": "user", "content": c}])) for k, c in zip(kinds, chats)]


class Generator:
    """Continuous-batched greedy decoding of many prompts with top-k logits kept for every position."""

    def __init__(self, path: str, n_seq: int, seq_len: int, n_batch: int = 512, threads: int = 1,
                 hidden: bool = False) -> None:
        # Own context, not LlamaCppDecoder's: a unified KV cache makes every token attend over all sequences'
        # cells, which at 32 sequences costs more than the model; split streams keep attention per sequence.
        self.dec = LlamaCppDecoder(path, DecoderOptions(n_ctx=256, n_batch=64))
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_seq * seq_len, n_batch, n_batch, n_seq
        cp.kv_unified, cp.no_perf = False, True
        # 1 by default: two spinning threads stall badly on a busy 2-core machine; run two processes instead
        cp.n_threads = cp.n_threads_batch = threads
        if hidden:  # final-norm hidden states from the same decode: Medusa's training data, at no extra pass
            cp.embeddings, cp.pooling_type = True, llama_cpp.LLAMA_POOLING_TYPE_NONE
        self.hidden = hidden
        self.ctx = llama_cpp.llama_init_from_model(self.dec.model.handle, cp)
        self.mem, self.vocab = llama_cpp.llama_get_memory(self.ctx), self.dec.vocab
        self.n_seq, self.seq_len, self.n_batch = n_seq, seq_len, n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> tuple[np.ndarray, np.ndarray | None]:
        """items: (token, pos, seq, want_logits); the logits (and hidden states) rows of the flagged items."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed: {rc}")
        n_out = sum(1 for it in items if it[3])
        ptr = llama_cpp.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(n_out, self.dec.n_vocab))
        if not self.hidden:
            return logits, None
        hid = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(self.ctx), shape=(n_out, self.dec.n_embd))
        return logits, hid.astype(np.float16)

    def run(self, prompts: list[list[int]], max_new: int, deadline: float, sample_temp: float = 0.0,
            stop_ids: set[int] | None = None, rng: np.random.Generator | None = None):
        """Yield (prompt_len, tokens, topk_idx, topk_val, hidden or None) per finished sequence until prompts or
        time run out; `prompts` may grow while this runs (follow-up prompts)."""
        stop_ids = stop_ids or {self.vocab.eos}
        queue = prompts  # popped from the end
        slots: list[dict | None] = [None] * self.n_seq
        while True:
            items: list[tuple[int, int, int, bool]] = []
            owners: list[tuple[int, int]] = []  # (slot, index of the token in the slot's sequence)
            budget = self.n_batch - self.n_seq
            for s in range(self.n_seq):
                st = slots[s]
                if st is None and queue and time.time() < deadline:
                    p = queue.pop()[: self.seq_len - max_new]
                    if len(p) > budget:
                        queue.append(p)
                        continue
                    budget -= len(p)
                    llama_cpp.llama_memory_seq_rm(self.mem, s, -1, -1)
                    st = slots[s] = {"toks": list(p), "plen": len(p), "idx": [], "val": [], "hid": [], "fed": 0}
                if st is None:
                    continue
                for j in range(st["fed"], len(st["toks"])):
                    items.append((st["toks"][j], j, s, True))
                    owners.append((s, j))
                st["fed"] = len(st["toks"])
            if not items:
                return
            logits, hid = self._decode(items)
            idx = np.argpartition(-logits, TOP_K, axis=1)[:, :TOP_K]
            val = np.take_along_axis(logits, idx, axis=1)
            order = np.argsort(-val, axis=1)
            idx, val = np.take_along_axis(idx, order, 1), np.take_along_axis(val, order, 1)
            last: dict[int, int] = {}
            for r, (s, j) in enumerate(owners):
                slots[s]["idx"].append(idx[r])
                slots[s]["val"].append(val[r])
                if hid is not None:
                    slots[s]["hid"].append(hid[r])
                last[s] = r
            for s, r in last.items():
                st = slots[s]
                if sample_temp > 0:
                    z = (val[r] - val[r].max()) / sample_temp
                    pr = np.exp(z) / np.exp(z).sum()
                    nxt = int(idx[r][rng.choice(TOP_K, p=pr)])
                else:
                    nxt = int(idx[r][0])
                n_new = len(st["toks"]) - st["plen"]
                if nxt in stop_ids or n_new >= max_new:
                    yield st["plen"], np.array(st["toks"], np.int32), np.array(st["idx"], np.int32), \
                        np.array(st["val"], np.float16), np.array(st["hid"]) if st["hid"] else None
                    slots[s] = None
                    llama_cpp.llama_memory_seq_rm(self.mem, s, -1, -1)
                else:
                    st["toks"].append(nxt)


def corpus(gen: Generator, rng: random.Random, deadline: float, out: str, t0: float) -> None:
    """Teacher logits over local text chunks (prefill only): off-policy, but ~3x cheaper per token than generating."""
    texts = code_prompts(rng, 10**6) + local_docs(rng, 10**6)
    src = Path(inspect.getfile(argparse)).parent
    for f in sorted(src.glob("*.py")):
        texts.append(f.read_text(errors="replace"))
    rng.shuffle(texts)
    chunks: list[list[int]] = []
    for t in texts:
        ids = gen.vocab.tokenize(t, add_special=False, parse_special=False)
        chunks += [ids[i : i + 384] for i in range(0, len(ids) - 64, 384)]
    rng.shuffle(chunks)
    seqs, n_tok = [], 0
    for _, toks, idx, val, _ in gen.run(list(reversed(chunks)), 1, deadline, 0.0, {-1}):
        seqs.append((toks[:-1], idx[:-1], val[:-1]))
        n_tok += len(toks) - 1
        if len(seqs) % 20 == 0:
            print(f"{len(seqs)} chunks, {n_tok} tokens, {time.time() - t0:.0f} s", flush=True)
    lens = np.array([len(s[0]) for s in seqs], np.int32)
    np.savez(out, plens=np.zeros_like(lens), lens=lens, tokens=np.concatenate([s[0] for s in seqs]),
             idx=np.concatenate([s[1] for s in seqs]), val=np.concatenate([s[2] for s in seqs]))
    print(f"wrote {out}: {len(seqs)} chunks, {n_tok} tokens in {time.time() - t0:.0f} s", flush=True)


def save(out: str, seqs: list[tuple], t0: float) -> None:
    """One npz: per sequence its prompt length and tokens, top-k ids/logits (and hidden states) per position."""
    plens = np.array([q[0] for q in seqs], np.int32)
    lens = np.array([len(q[1]) for q in seqs], np.int32)
    arrays = dict(plens=plens, lens=lens, tokens=np.concatenate([q[1] for q in seqs]),
                  idx=np.concatenate([q[2] for q in seqs]), val=np.concatenate([q[3] for q in seqs]))
    if seqs[0][4] is not None:
        arrays["hidden"] = np.concatenate([q[4] for q in seqs])
    np.savez(out, **arrays)
    print(f"wrote {out}: {len(seqs)} sequences, {int(lens.sum())} tokens ({int((lens - plens).sum())} generated) "
          f"in {time.time() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", default="0/1", help="K/N: this process takes every N-th prompt from K (run N side by side).")
    ap.add_argument("--n-seq", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--per-topic", type=int, default=6, help="Task templates per topic (at most 20).")
    ap.add_argument("--docs", type=int, default=400, help="Standard-library docstrings to make prompts from.")
    ap.add_argument("--self-prompts", type=int, default=200, help="User turns sampled from the target itself.")
    ap.add_argument("--save-every", type=float, default=20.0, help="Minutes between saves of what is done so far.")
    ap.add_argument("--hidden", action="store_true",
                    help="Also keep the final-norm hidden state at every position (Medusa data; 1.1 kB a token).")
    ap.add_argument("--corpus", action="store_true",
                    help="Instead: the target's top-k logits over local text (standard-library source and docstrings).")
    args = ap.parse_args()
    shard, n_shards = (int(x) for x in args.shard.split("/"))
    rng = random.Random(args.seed)  # the same prompt list in every shard; each takes its own slice
    nrng = np.random.default_rng(args.seed * 1000 + shard)
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    gen = Generator(args.target, args.n_seq, 1024, threads=args.threads, hidden=args.hidden)
    vocab = gen.vocab
    template = gen.dec.metadata("tokenizer.chat_template")
    im_end = vocab.tokenize("<|im_end|>", add_special=False, parse_special=True)
    stops = {vocab.eos, *im_end}
    tok = lambda s: vocab.tokenize(s, add_special=False, parse_special=True)  # noqa: E731
    text_of = lambda ids: b"".join(vocab.piece(int(t)) for t in ids).decode("utf-8", "replace").replace("<|im_end|>", "").strip()  # noqa: E731

    if args.corpus:
        return corpus(gen, rng, deadline, args.out, t0)
    # 1) user turns the target samples itself (temperature 1), for variety beyond the templates.
    head = render_chat(template, [{"role": "user", "content": "X"}]).split("X")[0]
    self_prompts: list[str] = []
    for plen, toks, *_ in gen.run([tok(head)] * args.self_prompts, 60, t0 + args.minutes * 60 * 0.08, 1.0, stops, nrng):
        if len(text := text_of(toks[plen:])) > 15:
            self_prompts.append(text)
    print(f"{len(self_prompts)} self-sampled prompts in {time.time() - t0:.0f} s", flush=True)

    docs = local_docs(rng, args.docs)
    prompts = make_prompts(rng, template, docs, args.per_topic, n_math=25 * args.per_topic)
    prompts += [("code", c) for c in code_prompts(rng, 50 * args.per_topic)]
    rng.shuffle(prompts)
    prompts = prompts[shard::n_shards]
    prompts += [("chat", render_chat(template, [{"role": "user", "content": p}])) for p in self_prompts]
    rng.shuffle(prompts)
    print(f"{len(prompts)} prompts in shard {shard}/{n_shards}", flush=True)

    # 2) greedy answers with top-k logits at every position, until the time budget runs out; articles and
    # German translations come back as the input of follow-up prompts (pushed where the queue pops next).
    # Prompts longer than one batch would never get a slot: leave them out.
    fits = lambda ids: len(ids) <= gen.n_batch - gen.n_seq  # noqa: E731
    queue, kind_of = [], {}
    for kind, p in prompts:
        if fits(ids := tok(p)):
            queue.append(ids)
            kind_of[tuple(ids)] = kind
    seqs, n_tok, saved = [], 0, time.time()
    for plen, toks, idx, val, hid in gen.run(queue, args.max_new, deadline, 0.0, stops):
        seqs.append((plen, toks, idx, val, hid))
        n_tok += len(toks)
        answer = text_of(toks[plen:])
        for follow in FOLLOW_UPS.get(kind_of.get(tuple(toks[:plen].tolist()), ""), []):
            if len(answer) > 40 and fits(ids := tok(render_chat(template, [{"role": "user", "content": follow.format(x=answer)}]))):
                queue.append(ids)
        if len(seqs) % 50 == 0:
            print(f"{len(seqs)} sequences, {n_tok} tokens, {len(queue)} queued, {time.time() - t0:.0f} s", flush=True)
        if time.time() - saved > 60 * args.save_every:  # a long run cut short keeps what it made
            save(args.out, seqs, t0)
            saved = time.time()
    save(args.out, seqs, t0)


if __name__ == "__main__":
    main()
