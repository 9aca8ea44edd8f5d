"""Errors ggufspec raises; the CLI turns them into a message and their exit code (2 for bad input)."""

from __future__ import annotations

EXIT_FAILED = 1  # the CLI's exit code when something outside the input failed (an RPC server that went away)
EXIT_BAD_INPUT = 2  # the CLI's exit code for bad input (click's for usage errors)
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT


class GGUFSpecError(Exception):
    """Base class: the message says what was wrong, which file or value, and what to do next."""

    exit_code = EXIT_BAD_INPUT


class RPCError(GGUFSpecError):
    """An RPC endpoint that cannot be used, or an RPC server that failed (rpc.py, isolated.py)."""

    exit_code = EXIT_FAILED


class EndpointError(RPCError):
    """An RPC endpoint written wrong (no port, a bad port, IPv6, given twice): a usage error, exit code 2."""

    exit_code = EXIT_BAD_INPUT


class ModelFileError(GGUFSpecError):
    """A model file is missing, unreadable, not GGUF, truncated or inconsistent."""


class PairingError(GGUFSpecError):
    """Target and draft cannot be paired (different vocabularies or special tokens)."""


class ContextLengthError(GGUFSpecError):
    """A prompt does not fit the context window."""

    @classmethod
    def prompt(cls, n_tokens: int, n_ctx: int, at_least: bool = False) -> ContextLengthError:
        """A prompt of `n_tokens` tokens (`at_least`: a bound from its length, before tokenizing) for `n_ctx`."""
        return cls(f"the prompt has {'at least ' if at_least else ''}{n_tokens} tokens and the context holds "
                   f"{n_ctx}: shorten the prompt or raise --n-ctx")


class ConversionError(GGUFSpecError):
    """A checkpoint cannot be converted or quantized."""


class Cancelled(GGUFSpecError):
    """Work stopped because whoever asked for it went away (a server request whose client disconnected)."""
