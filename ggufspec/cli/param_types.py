"""The click parameter types of the option table (options.py): token counts, byte sizes, llama.cpp's --spec-type
and --chat-template spellings. Each refuses a bad value with one usage error that says what to give instead."""

from __future__ import annotations

from typing import Any, Mapping

import click

from ..errors import GGUFSpecError


class MaxTokens(click.ParamType):
    """-n/--max-tokens: at least 1, or -1 (llama.cpp's "until the context ends"), which gives None."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or isinstance(value, int) and value >= 1:
            return value
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of tokens", param, ctx)
        if n == -1:
            return None
        if n < 1:
            self.fail(f"{n}: give at least 1 token, or -1 for up to the end of the context", param, ctx)
        return n


class ByteSize(click.ParamType):
    """A size in bytes: 1048576, 512k, 8M, 1G (powers of 1024)."""

    name = "size"
    _UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().removesuffix("b").removesuffix("i")
        unit = text[-1:] if text[-1:] in self._UNITS else ""
        number = text[: len(text) - len(unit)]
        if not number.isdigit() or int(number) < 1:
            self.fail(f"{value!r} is not a size: give bytes, or a number with k, M or G", param, ctx)
        return int(number) * self._UNITS[unit]


#: llama.cpp's --spec-type names (common/speculative.cpp) and the method that drafts so here; a list naming both a
#: draft model and n-grams is `auto`, which drafts from both where that pays.
SPEC_TYPES: Mapping[str, str] = {
    "none": "autoregressive", "draft-simple": "vanilla", "draft-mtp": "mtp",
    **dict.fromkeys(("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"), "lookup"),
}
#: ... and the ones with no counterpart here: what each drafts with
SPEC_TYPES_ELSEWHERE: Mapping[str, str] = {
    "draft-eagle3": "EAGLE-3 heads",
    "draft-dflash": "DFlash drafts", "draft-dspark": "DSpark drafts",
}


class SpecType(click.ParamType):
    """--spec-type, llama.cpp's comma list of speculative types: the method here that drafts as they do."""

    name = "TYPE[,TYPE]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        for n in names:
            if n in SPEC_TYPES_ELSEWHERE:
                self.fail(f"{n}: ggufspec does not draft with {SPEC_TYPES_ELSEWHERE[n]}; use a draft model (-md "
                          "DRAFT.gguf, draft-simple), n-grams (ngram-mod), the model's MTP head (draft-mtp) or Medusa "
                          "heads (--method medusa --medusa HEADS.gguf)", param, ctx)
            if n not in SPEC_TYPES:
                self.fail(f"{n!r} is none of llama.cpp's types that ggufspec runs: {', '.join(SPEC_TYPES)}", param, ctx)
        if not names:
            self.fail(f"give one or more of {', '.join(SPEC_TYPES)}, separated by commas", param, ctx)
        methods = {SPEC_TYPES[n] for n in names} - {"autoregressive"} or {"autoregressive"}  # `none` adds nothing
        return "auto" if len(methods) > 1 else methods.pop()


class ChatTemplateName(click.ParamType):
    """--chat-template: one of llama.cpp's built-in template names, or a Jinja template (chat.template_override)."""

    name = "NAME|JINJA"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..chat import template_override

        if not isinstance(value, str):
            return value
        try:
            return template_override(value)
        except GGUFSpecError as e:
            self.fail(str(e), param, ctx)
