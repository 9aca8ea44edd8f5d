"""Batch jobs: `ggufspec generate --batch PROMPTS -o OUT.jsonl [--parallel N]`.

Every prompt of a file is generated (up to N at once on an EnginePool) and its result appended to OUT.jsonl as one
JSON line the moment it finishes, in completion order, each line naming its prompt (`index`, `id`). A run that
stops (Ctrl-C, a crash, a full disk) leaves the finished lines; the same command again keeps them and generates the
rest (a partial last line is dropped; prompts whose line records an error are tried again).

Input: one prompt a line. A line that starts with `{` is a JSON object that gives its prompt in `messages` (chat
messages), `turns` (Spec-Bench/MT-Bench: the first turn, as a user message) or `prompt` (text, or token ids:
HumanEval's shape), and its id in `custom_id`, `id`, `question_id` or `task_id` (else its line number); any other
line is a text prompt as it is. A line that starts with `{` but is not such an object stops the run before any
model loads, naming the line: it is a broken JSON line, which sent as text would be a silently wrong prompt (a
text prompt that starts with `{` is written as {"prompt": "..."}). Chat-shaped prompts go through the model's chat
template; text prompts follow generate's rule (the template when the model has one, unless --raw). `bench` reads
its prompt files with the same reader (`read_prompts`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from .errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, GGUFSpecError
from .outputs import remove_quietly, same_file, temp_path
from .stats import Stats

ID_FIELDS = ("custom_id", "id", "question_id", "task_id")  # the first one present names a JSON line's prompt
PROMPT_FIELDS = ("messages", "turns", "prompt")
# OpenAI's finish reasons: the engine's "max_tokens" (-n reached) and "length" (the context is full) are both cut
# by a length; "stop_reason" in each line keeps the engine's own word.
FINISH_REASONS = {"stop": "stop", "max_tokens": "length", "length": "length", "interrupted": "length"}
ID_TYPES = (str, int)


@dataclass(frozen=True)
class BatchPrompt:
    """One prompt of the input: its place among the prompts, its id, its line, and what it asks."""

    index: int  # 0-based among the prompts (blank lines are not prompts)
    id: str | int  # the input's id, else the line number
    line: int  # 1-based line of the input file
    text: str | None = None  # a text prompt (templated or not, as generate decides)
    messages: tuple[dict[str, str], ...] | None = None  # chat messages: always the chat template
    tokens: tuple[int, ...] | None = None  # token ids: as they are
    category: str | None = None  # a JSON line's `category` (Spec-Bench's): bench groups its figures by it

    @property
    def needs_template(self) -> bool:
        return self.messages is not None


# --- input ------------------------------------------------------------------------------------------------------

def read_prompts(path: str | os.PathLike) -> list[BatchPrompt]:
    """The prompts of `path` (see the module's doc); GGUFSpecError naming the file and line of anything wrong."""
    p = Path(path)
    if not p.exists():
        raise GGUFSpecError(f"{p}: no such prompt file.")
    if not p.is_file():
        raise GGUFSpecError(f"{p}: not a file; give a JSONL or text file of prompts, one a line.")
    data = p.read_bytes()
    prompts: list[BatchPrompt] = []
    for n, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError as e:
            raise GGUFSpecError(f"{p}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                "convert the file first, e.g. iconv -f LATIN1 -t UTF-8") from None
        if n == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(_json_prompt(p, n, len(prompts), line))
        else:
            prompts.append(BatchPrompt(len(prompts), n, n, text=line))
    if not prompts:
        raise GGUFSpecError(f"{p}: no prompts in it (give one a line: text, or JSON objects with a `prompt`, "
                            "`messages` or `turns` field).")
    return prompts


def _json_prompt(path: Path, n: int, index: int, line: str) -> BatchPrompt:
    """The prompt of JSON line `n` (see the module's doc); GGUFSpecError naming the file and line when it is not one."""
    where = f"{path}:{n}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise GGUFSpecError(f"{where}: not a JSON object ({e.msg} at column {e.colno}); a line that starts with `{{` "
                            "must be one (a text prompt that starts with `{`: write it as {\"prompt\": \"...\"})."
                            ) from None
    if not isinstance(obj, dict):  # e.g. `{"a": 1} trailing` fails above; this guards odd decoders
        raise GGUFSpecError(f"{where}: not a JSON object.")
    pid: Any = n
    for name in ID_FIELDS:
        if obj.get(name) is not None:
            pid = obj[name]
            if not isinstance(pid, ID_TYPES) or isinstance(pid, bool):
                raise GGUFSpecError(f"{where}: `{name}` must be a string or an integer, got {json.dumps(pid)[:40]}.")
            break
    category = obj.get("category")
    if category is not None and (not isinstance(category, ID_TYPES) or isinstance(category, bool)):
        raise GGUFSpecError(f"{where}: `category` must be a string or an integer, got {json.dumps(category)[:40]}.")
    return BatchPrompt(index, pid, n, category=None if category is None else str(category),
                       **_prompt_fields(where, obj))


def _prompt_fields(where: str, obj: dict[str, Any]) -> dict[str, Any]:
    """BatchPrompt's `messages`, `tokens` or `text` from the first prompt field of `obj` (PROMPT_FIELDS' order)."""
    key = next((f for f in PROMPT_FIELDS if f in obj), None)
    if key is None:
        raise GGUFSpecError(f"{where}: needs a `prompt` (text), `messages` (chat) or `turns` (Spec-Bench) field; "
                            f"it has {', '.join(f'`{k}`' for k in obj) or 'none'}.")
    value = obj[key]
    if key == "messages":
        if not isinstance(value, list) or not value or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value):
            raise GGUFSpecError(f"{where}: `messages` must be a non-empty list of objects with a string `role` and "
                                "`content`.")
        return {"messages": tuple({"role": m["role"], "content": m["content"]} for m in value)}
    if key == "turns":
        if not isinstance(value, list) or not value or not isinstance(value[0], str) or not value[0].strip():
            raise GGUFSpecError(f"{where}: `turns` must be a list of strings, the first one not empty.")
        return {"messages": ({"role": "user", "content": value[0]},)}
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return {"tokens": tuple(value)}
    if not isinstance(value, str):
        raise GGUFSpecError(f"{where}: `prompt` must be a string (or a list of token ids).")
    if not value.strip():
        raise GGUFSpecError(f"{where}: the prompt is empty.")
    return {"text": value}


def engine_prompt(p: BatchPrompt, templated: bool, system: str | None) -> str | list:
    """What the engine gets for `p`: chat messages (with the --system message first, unless they have their own),
    the text as it is, or token ids. `templated`: text prompts go in the chat template (generate's rule)."""
    if p.tokens is not None:
        return list(p.tokens)
    if p.messages is not None:
        messages = list(p.messages)
    elif templated:
        messages = [{"role": "user", "content": p.text}]
    else:
        return p.text
    if system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


# --- output -----------------------------------------------------------------------------------------------------

def check_output(out: str | os.PathLike, inputs: Path) -> Path:
    out = Path(out)
    if out.is_dir():
        raise GGUFSpecError(f"-o {out}: is a directory; give a file name for the results.")
    if not out.absolute().parent.is_dir():
        raise GGUFSpecError(f"-o {out}: the folder {out.absolute().parent} does not exist; create it first.")
    if same_file(out, inputs):
        raise GGUFSpecError(f"-o {out}: that is the prompt file; give another file name for the results.")
    return out


def read_done(out: Path, prompts: list[BatchPrompt]) -> tuple[set[int], int, int]:
    """The prompts `out` already holds a result for: (their indexes, partial lines dropped, error lines dropped).

    Lines to drop (an incomplete last line, which an interrupted write leaves; lines recording an error, to be
    tried again; a repeated prompt) are removed from `out` at once, through a temp file and a rename. A line that
    is not a result line of these prompts (not JSON, another index or id) stops the run: `out` is then another
    file, or the results of another input, and is left as it is."""
    if not out.exists():
        return set(), 0, 0
    data = out.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline: empty unless a write was cut short
    partial = newline = 0
    if tail.strip():
        if _is_object(tail):  # whole, only its newline missing (a file written by hand): kept
            lines.append(tail)
            newline = 1
        else:  # cut short: a JSON object cut anywhere is no longer one
            partial = 1
    kept: list[bytes] = []
    done: set[int] = set()
    errors = repeated = 0
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if n == len(lines) and not partial:  # a cut line followed by a newline: the same, dropped
                partial = 1
                continue
            raise GGUFSpecError(f"-o {out}:{n}: not a JSON line of batch results; give another -o file (or delete "
                                "this one to start over).") from None
        index = obj.get("index") if isinstance(obj, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(prompts):
            raise GGUFSpecError(f"-o {out}:{n}: not a result of these {len(prompts)} prompts (its `index` is "
                                f"{json.dumps(index)}); give another -o file (or delete this one to start over).")
        if obj.get("id") != prompts[index].id:
            raise GGUFSpecError(f"-o {out}:{n}: prompt {index} has id {json.dumps(obj.get('id'))} there, but "
                                f"{json.dumps(prompts[index].id)} in the prompt file: these are the results of another "
                                "input; give another -o file (or delete this one to start over).")
        if obj.get("error") is not None:
            errors += 1
            continue
        if index in done:
            repeated += 1
            continue
        done.add(index)
        kept.append(raw + b"\n")
    if partial or errors or repeated or newline:
        _rewrite(out, b"".join(kept))
    return done, partial, errors


def _is_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def _rewrite(out: Path, data: bytes) -> None:
    tmp = temp_path(out)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, out)
    except OSError as e:
        remove_quietly(tmp)
        raise GGUFSpecError(f"-o {out}: cannot rewrite it without its unfinished lines: {e.strerror or e}") from None
    except BaseException:
        remove_quietly(tmp)
        raise


def result_line(p: BatchPrompt, result) -> dict[str, Any]:
    """A finished prompt's line: OpenAI's `usage` and `finish_reason`, llama-server's `timings`."""
    s = result.stats
    prompt_ms, predicted_ms = s.prefill_seconds * 1e3, s.generation_seconds * 1e3
    return {
        "id": p.id, "index": p.index, "text": result.text,
        "finish_reason": FINISH_REASONS[result.stop_reason], "stop_reason": result.stop_reason,
        "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
                  "total_tokens": s.prompt_tokens + s.generated_tokens},
        "timings": {"prompt_n": s.prefill_tokens, "prompt_ms": prompt_ms, "prompt_per_second": s.prefill_tps,
                    "cache_n": s.cached_tokens, "predicted_n": s.generated_tokens, "predicted_ms": predicted_ms,
                    "predicted_per_second": s.generation_tps, "draft_n": s.drafted, "draft_n_accepted": s.accepted,
                    "method": s.method, "target_passes": s.target_passes, "tokens_per_pass": s.mean_accepted_length},
        "error": None,
    }


def error_line(p: BatchPrompt, e: BaseException) -> dict[str, Any]:
    """A failed prompt's line (OpenAI batch output's `error`: code and message); the text is null."""
    return {"id": p.id, "index": p.index, "text": None, "finish_reason": None,
            "error": {"code": type(e).__name__, "message": str(e) or type(e).__name__}}


# --- the run ----------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What a run wrote: lines, failures, and the totals of its finished prompts."""

    written: int = 0
    failed: list[tuple[BatchPrompt, BaseException]] = field(default_factory=list)
    completion_tokens: int = 0
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0  # generating: from the first prompt sent to the slots to the last line written
    wall_seconds: float = 0.0  # the whole run: reading the prompts, loading the models, measuring costs, generating

    def add(self, stats: Stats) -> None:
        """A finished prompt's tokens, passes and drafts."""
        self.completion_tokens += stats.generated_tokens
        self.target_passes += stats.target_passes
        self.drafted += stats.drafted
        self.accepted += stats.accepted


def duration(seconds: float) -> str:
    """A span of time as a person reads it: 19.9 s, 2 min 17 s, 1 h 05 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def _summary(outcome: Outcome, out: Path, done_before: int, total: int, show_stats: bool) -> str:
    """The closing line: lines written, prompts done, time generating (what tok/s is over) and the whole run's
    wall time, which adds loading the models and measuring costs (minutes on a busy machine)."""
    ok = outcome.written - len(outcome.failed)
    tps = outcome.completion_tokens / outcome.seconds if outcome.seconds else 0.0
    summary = (f"wrote {outcome.written} line{'s' * (outcome.written != 1)} to {out} ({done_before + ok} of {total} "
               f"prompts done) in {duration(outcome.seconds)} generating, {duration(outcome.wall_seconds)} in all "
               f"(with loading the models): {outcome.completion_tokens} tokens, {tps:.2f} tok/s while generating")
    if show_stats:
        summary += f" | {outcome.target_passes} target passes"
        if outcome.drafted:
            summary += f", acceptance {outcome.accepted / outcome.drafted:.1%} ({outcome.accepted}/{outcome.drafted})"
    return summary


def run_batch(*, batch_path: str, output: str, parallel: int, chat: bool, raw: bool, system: str | None,
              show_stats: bool, truncate_prompt: bool, context_shift: bool, params: dict,
              load_engine: Callable[..., Any]) -> int:
    """`generate --batch`: the exit code (0 all done, 2 when prompts failed, 130 interrupted)."""
    started = time.perf_counter()
    source = Path(batch_path)
    prompts = read_prompts(source)  # bad input fails before any model loads
    out = check_output(output, source)
    done, todo = _resume(prompts, out)
    if not todo:
        click.echo(f"all {len(prompts)} prompts are done in {out}", err=True)
        return 0
    pool, settings = load_engine(params, parallel=parallel, truncate_prompt=truncate_prompt,
                                 context_shift=context_shift)
    with pool:
        engine = pool.engine
        templated = not raw and (chat or system is not None or engine.has_chat_template)
        need = next((p for p in todo if p.needs_template or (templated and p.text is not None)), None)
        if need is not None and not engine.has_chat_template:
            raise GGUFSpecError(f"{source}:{need.line}: chat messages, but {engine.target.path} has no chat template "
                                "(tokenizer.chat_template): give text prompts, without --chat or --system.")
        click.echo(f"batch: {len(todo)} prompt{'s' * (len(todo) != 1)} from {source}, {pool.parallel} at once "
                   f"({engine.describe(settings)}) -> {out}", err=True)
        stream = pool.stream_many([engine_prompt(p, templated, system) for p in todo], settings)
        outcome = Outcome()
        try:
            _write_results(stream, todo, out, outcome)
        except KeyboardInterrupt:
            finished = len(done) + outcome.written - len(outcome.failed)
            click.echo(f"interrupted: {finished} of {len(prompts)} prompts done, kept in {out}; run the same "
                       "command again to generate the rest.", err=True)
            return EXIT_INTERRUPTED
        finally:
            stream.close()  # every slot stops at its next token
    outcome.wall_seconds = time.perf_counter() - started
    click.echo(_summary(outcome, out, len(done), len(prompts), show_stats), err=True)
    if outcome.failed:
        p, e = outcome.failed[0]
        n = len(outcome.failed)
        click.echo(f"error: {n} prompt{'s' * (n != 1)} failed, first {source}:{p.line} (index {p.index}): {e}. "
                   f"Their lines in {out} carry the error; run the same command again to retry them.", err=True)
        return EXIT_BAD_INPUT
    return 0


def _resume(prompts: list[BatchPrompt], out: Path) -> tuple[set[int], list[BatchPrompt]]:
    """The prompts OUT already holds results of (said on stderr) and those left to generate."""
    done, partial, errors = read_done(out, prompts)
    if done or partial or errors:
        notes = [f"{len(done)} of {len(prompts)} prompts already done in {out}"]
        if partial:
            notes.append("an unfinished last line dropped")
        if errors:
            notes.append(f"{errors} failed prompt{'s' * (errors != 1)} to try again")
        click.echo(f"resuming: {'; '.join(notes)}", err=True)
    return done, [p for p in prompts if p.index not in done]


def _write_results(stream: Iterator, todo: list[BatchPrompt], out: Path, outcome: Outcome) -> None:
    """Each prompt's result line appended to `out` as it finishes (flushed), counted in `outcome` (what an
    interruption leaves is counted too); a progress bar on stderr."""
    t0 = time.perf_counter()
    try:
        with open(out, "a", encoding="utf-8") as f, \
                click.progressbar(length=len(todo), label="generating", file=sys.stderr) as bar:
            for k, r in stream:
                p = todo[k]
                if isinstance(r, BaseException):
                    line = error_line(p, r)
                    outcome.failed.append((p, r))
                elif r.finish_reason is None:
                    continue
                else:
                    line = result_line(p, r.result)
                    outcome.add(r.result.stats)
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
                f.flush()
                outcome.written += 1
                bar.update(1)
    except OSError as e:
        raise GGUFSpecError(f"-o {out}: cannot write the results: {e.strerror or e} (the lines written so far "
                            "are kept; run the same command again to resume)") from None
    outcome.seconds = time.perf_counter() - t0
