"""Chat prompts: messages rendered with the Jinja chat template stored in the GGUF, then tokenized."""

from __future__ import annotations

import functools
from typing import TypedDict

from jinja2.exceptions import TemplateError
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from .errors import GGUFSpecError
from .vocab import Vocab


class Message(TypedDict):
    role: str
    content: str


@functools.lru_cache(maxsize=8)
def _formatter(template: str, bos_token: str, eos_token: str, add_generation_prompt: bool) -> Jinja2ChatFormatter:
    return Jinja2ChatFormatter(template, eos_token, bos_token, add_generation_prompt)


def render_chat(
    template: str | None, messages: list[Message], bos_token: str = "", eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for `messages`; raises GGUFSpecError when the model has no usable template."""
    if not template:
        raise GGUFSpecError("this model has no chat template (tokenizer.chat_template); pass a plain prompt without --chat.")
    try:
        formatter = _formatter(template, bos_token, eos_token, add_generation_prompt)
        return formatter(messages=messages).prompt
    except (TemplateError, ValueError) as e:  # the template's raise_exception() raises ValueError
        raise GGUFSpecError(f"the model's chat template failed: {e}") from None


def chat_tokens(vocab: Vocab, template: str | None, messages: list[Message]) -> list[int]:
    """Token ids of `messages` in the chat template, with the BOS the GGUF asks for exactly once
    (whether or not the template writes it)."""
    bos = vocab.piece(vocab.bos, special=True).decode("utf-8", "replace") if vocab.bos >= 0 else ""
    eos = vocab.piece(vocab.eos, special=True).decode("utf-8", "replace") if vocab.eos >= 0 else ""
    text = render_chat(template, messages, bos, eos)
    return vocab.tokenize(text, add_special=not (bos and text.startswith(bos)), parse_special=True)
