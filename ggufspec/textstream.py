"""Token bytes to text pieces: UTF-8 safe across token boundaries, stop strings never leaked."""

from __future__ import annotations

import codecs


class TextStream:
    """Feed token bytes, get the text that is safe to show; `stopped` once a stop string appears."""

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # text that may be the start of a stop string
        self._pieces: list[str] = []  # everything emitted so far (joined on demand: += on a long text is quadratic)
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def push(self, data: bytes) -> str:
        """Add one token's bytes; return the newly showable text."""
        if self.stopped:
            return ""
        if not self._stop:
            piece = self._utf8.decode(data)
            self._pieces.append(piece)
            return piece
        self._held += self._utf8.decode(data)
        cut = min((i for i in (self._held.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(self._held[:cut])
        keep = max((k for s in self._stop for k in range(min(len(s) - 1, len(self._held)), 0, -1)
                    if self._held.endswith(s[:k])), default=0)
        return self._emit(self._held[: len(self._held) - keep])

    def flush(self) -> str:
        """At the end: whatever was held back (no stop string completed), and any partial UTF-8."""
        if self.stopped:
            return ""
        return self._emit(self._held + self._utf8.decode(b"", final=True))

    def _emit(self, piece: str) -> str:
        self._held = self._held[len(piece):]
        self._pieces.append(piece)
        return piece
