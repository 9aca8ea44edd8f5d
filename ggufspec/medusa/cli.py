"""`ggufspec medusa train`: Medusa heads for any GGUF target, from its own answers or from plain text."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import numpy as np


@click.group("medusa")
def medusa() -> None:
    """Medusa heads: train them for a GGUF target."""


@medusa.command("train")
@click.argument("target", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--prompts", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Prompts (JSONL with turns/prompt/text, or one a line): the target's greedy answers are the data.")
@click.option("--text", "text_file", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Plain text to train on as well (or instead).")
@click.option("--data", "data_cache", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Cache of collected hidden states (.npz): reused when it exists, written otherwise.")
@click.option("--heads", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option("--max-new", type=click.IntRange(1), default=256, show_default=True, help="Longest answer per prompt.")
@click.option("--parallel", type=click.IntRange(1, 64), default=8, show_default=True, help="Answers generated per batch.")
@click.option("--no-chat", is_flag=True, help="Feed prompts as they are, without the target's chat template.")
@click.option("--epochs", type=click.IntRange(1), default=10, show_default=True)
@click.option("--batch", type=click.IntRange(1), default=256, show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--weight-decay", type=float, default=0.0, show_default=True)
@click.option("--soft-weight", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="With a --data cache that holds the target's top logits: share of the loss on that distribution.")
@click.option("--tree-nodes", type=click.IntRange(0, 255), default=63, show_default=True,
              help="Fit a candidate tree of this many nodes to the trained heads on held-out answers and store it "
              "with them (used when `generate` gets no --tree); 0: none.")
@click.option("--own-lm-head", is_flag=True, help="Write v1 heads with a copy of the target's output matrix each "
              "(default: v2 heads that share the target's, much smaller).")
@click.option("--outtype", type=click.Choice(["f16", "f32", "q8_0"]), default="f16", show_default=True)
@click.option("--checkpoint-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Also write the heads as a FasterDecoding checkpoint (medusa_lm_head.safetensors + config.json, "
              "for the Medusa authors' code) in this folder (default: none).")
@click.option("-t", "--threads", type=click.IntRange(1), default=None, help="llama.cpp threads for collection.")
def train_cmd(target: Path, out: Path, prompts: Path | None, text_file: Path | None, data_cache: Path | None,
              heads: int, max_new: int, parallel: int, no_chat: bool, epochs: int, batch: int, lr: float,
              weight_decay: float, soft_weight: float, tree_nodes: int, own_lm_head: bool, outtype: str,
              checkpoint_dir: Path | None, threads: int | None) -> None:
    """Collect hidden states of TARGET, train Medusa heads on them, and write the heads to OUT (GGUF)."""
    # before hours of work, not after, and before importing llama.cpp
    _refuse_clobbering(out, checkpoint_dir, [target, prompts, text_file, data_cache])

    from .checkpoint import save_checkpoint
    from .format import HeadSet, write_heads
    from .heads import target_lm_head
    from .train import TrainConfig, train_heads, training_pairs

    say = _printer()
    start = time.perf_counter()
    corpus = _corpus(target, prompts, text_file, data_cache, max_new, parallel, no_chat, threads, say)
    lm = target_lm_head(target)
    data = training_pairs(corpus, heads)
    if data.hidden.shape[1] != lm.shape[1]:
        raise click.UsageError(f"the data has hidden size {data.hidden.shape[1]}, {target} has {lm.shape[1]}: wrong --data cache?")
    say(f"training {heads} heads on {len(data.rows)} positions, hidden {lm.shape[1]}, vocab {lm.shape[0]}", force=True)
    t_train = time.perf_counter()
    cfg = TrainConfig(heads, epochs, batch, lr, weight_decay, soft_weight=soft_weight)
    blocks, history = train_heads(data, lm, cfg, say)
    choices = _fitted_tree(blocks, lm, data, cfg, tree_nodes, say) if tree_nodes else None
    lm_heads = [lm] * heads if own_lm_head else None
    trained_set = HeadSet(1 if own_lm_head else 2, lm.shape[1], lm.shape[0], target.name, blocks, lm_heads, choices,
                          name=out.stem)
    for note in write_heads(out, trained_set, outtype):
        say(f"note: {note}", force=True)
    if checkpoint_dir is not None:
        save_checkpoint(checkpoint_dir, blocks, lm_heads, base_model=target.name, vocab_size=lm.shape[0], choices=choices)
    tops = " ".join(f"{history[f'top1_head{i}'][-1]:.1%}" for i in range(heads))
    click.echo(f"wrote {out}: {heads} heads (v{trained_set.version}), validation top-1 per head {tops}; "
               f"training {time.perf_counter() - t_train:.0f} s, total {time.perf_counter() - start:.0f} s"
               + (f"; checkpoint in {checkpoint_dir}" if checkpoint_dir is not None else ""))


def _corpus(target: Path, prompts: Path | None, text_file: Path | None, data_cache: Path | None, max_new: int,
            parallel: int, no_chat: bool, threads: int | None, say):
    """The target's hidden states to train on: from --data where it exists, else collected from its answers to
    --prompts and/or its reading of --text (and saved to --data when given)."""
    from .train import Corpus, chat_tokens, collect_generations, collect_text, open_for_collection, read_prompts

    if data_cache is not None and data_cache.exists():
        corpus = Corpus.load(data_cache)
        say(f"loaded {corpus.n_tokens} tokens of hidden states from {data_cache}", force=True)
        return corpus
    if prompts is None and text_file is None:
        raise click.UsageError("give --prompts and/or --text (or an existing --data cache).")
    start = time.perf_counter()
    texts = read_prompts(prompts) if prompts else []
    d = open_for_collection(target, parallel, max_new + 2 + 1024, threads)
    try:
        corpus = Corpus([], [])
        if texts:
            ids = [(d.vocab.tokenize(p) if no_chat else chat_tokens(d, p))[-1024:] for p in texts]
            corpus = collect_generations(d, ids, max_new, parallel, say)
        if text_file:
            more = collect_text(d, [text_file.read_text(encoding="utf-8")], 512, say)
            corpus = Corpus(corpus.tokens + more.tokens, corpus.hidden + more.hidden)
    finally:
        d.close()
    say(f"collected {corpus.n_tokens} tokens in {time.perf_counter() - start:.0f} s", force=True)
    if data_cache is not None:
        corpus.save(data_cache)
    return corpus


def _fitted_tree(blocks, lm, data, cfg, tree_nodes: int, say) -> list | None:
    """A tree of `tree_nodes` nodes fitted to the trained heads on the held-out positions; None where they ranked
    no held-out token high enough (generate then uses the default tree)."""
    from ..trees import DEFAULT_TREE, TREES
    from .fit import fit_heads_tree, tree_accepted
    from .heads import Heads, MedusaHeads
    from .train import held_out

    trained = Heads(MedusaHeads(2, lm.shape[1], lm.shape[0], "", blocks, None), lm)
    choices, fitted, ranks = fit_heads_tree(trained, data, held_out(data, cfg), tree_nodes)
    if choices:
        say(f"tree: {len(choices)} nodes fitted on {len(ranks)} held-out positions, ~{1 + fitted:.2f} tokens per pass "
            f"there ({DEFAULT_TREE}: ~{1 + tree_accepted(ranks, TREES[DEFAULT_TREE]):.2f})", force=True)
        return choices
    say(f"tree: the heads ranked no held-out token high enough ({len(ranks)} positions); none stored, "
        f"generate will use {DEFAULT_TREE}", force=True)
    return None


@medusa.command("tree")
@click.argument("target", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("heads_path", metavar="HEADS", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("data", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--nodes", type=click.IntRange(1, 255), default=63, show_default=True)
def tree_cmd(target: Path, heads_path: Path, data: Path, out: Path, nodes: int) -> None:
    """Fit a candidate tree to HEADS on the answers in DATA (a `medusa train --data` cache) and write it to OUT
    (JSON, for `generate --tree OUT`). Use answers the heads were not trained on."""
    from ..outputs import refuse_overwriting_inputs, temp_output
    from ..gguf_check import read_header
    from ..trees import DEFAULT_TREE, TREES
    from .fit import fit_heads_tree, tree_accepted
    from .heads import Heads
    from .train import Corpus, training_pairs

    refuse_overwriting_inputs(out, [target, heads_path, data])
    meta = read_header(target).metadata
    n_embd = int(meta.get(f"{meta.get('general.architecture')}.embedding_length", 0))
    heads = Heads.load(heads_path, target, n_embd, int(meta.get("tokenizer.ggml.tokens", 0)))
    pairs = training_pairs(Corpus.load(data), heads.n_heads)
    choices, accepted, ranks = fit_heads_tree(heads, pairs, np.arange(len(pairs.rows)), nodes)
    if not choices:
        raise click.UsageError(f"the heads ranked no token of {data} high enough to fit a tree")
    with temp_output(out) as tmp:
        tmp.write_text(json.dumps(choices) + "\n", encoding="utf-8")
    click.echo(f"wrote {out}: {len(choices)} nodes, ~{1 + accepted:.2f} tokens per pass on {len(ranks)} positions "
               f"({DEFAULT_TREE}: ~{1 + tree_accepted(ranks, TREES[DEFAULT_TREE]):.2f})")


def _refuse_clobbering(out: Path, ckpt: Path | None, inputs: list[Path | None]) -> None:
    """Raise ConversionError when OUT or a checkpoint file `train` writes (with --checkpoint-dir CKPT) is, or links
    to, one of `inputs` (TARGET, --prompts, --text, --data), when OUT is the checkpoint folder, or when OUT's folder
    is missing."""
    from ..errors import ConversionError
    from ..outputs import check_output_path, refuse_overwriting_inputs, same_file
    from .checkpoint import CHECKPOINT_FILES

    check_output_path(out)
    written = [] if ckpt is None else [ckpt / name for name in CHECKPOINT_FILES]
    refuse_overwriting_inputs(out, [*inputs, *written])
    for path in written:
        refuse_overwriting_inputs(path, inputs)
    if ckpt is not None and same_file(out, ckpt):
        raise ConversionError(f"{out}: is also the checkpoint folder (--checkpoint-dir); choose another file name")


def _printer():
    """Progress lines on stderr, at most one every 2 s unless forced."""
    last = [0.0]

    def say(message: str, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - last[0] >= 2.0 or "validation" in message:
            click.echo(message, err=True)
            sys.stderr.flush()
            last[0] = now

    return say
