"""The rules every writer of files shares (ggufspec.convert, `medusa train`, the measurement caches): the output must not be one of the inputs
(`refuse_overwriting_inputs`), and it is written through a temp file that failures and signals remove
(`temp_output`), with OS errors reported against the output folder (`write_error`).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from ggufspec.errors import ConversionError

# --- inputs and outputs ---------------------------------------------------------------------------------------


def same_file(a: Path, b: Path) -> bool:
    """Whether paths `a` and `b` name one file: the same inode (a symlink or hard link to it counts), or the same
    resolved path (which also catches an output that does not exist yet but would land on the input's name)."""
    try:
        sa, sb = os.stat(a), os.stat(b)  # follows symlinks
        if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
            return True
    except OSError:
        pass  # one of them does not exist (yet): only the names can collide
    return Path(a).resolve() == Path(b).resolve()


def refuse_overwriting_inputs(out: Path, inputs: Iterable[Path | None]) -> None:
    """Raise ConversionError when `out` is, or links to, any of `inputs` (None entries are skipped).

    Call it before anything is written: the output would replace a file the command reads (the user's checkpoint,
    tokenizer or source GGUF). A path through a linked folder lands on the input itself; a symlink or hard link to
    an input is refused as well, since its name almost certainly stands for that file.
    """
    out = Path(out)
    for inp in inputs:
        if inp is None or not same_file(out, Path(inp)):
            continue
        if os.path.abspath(out) == os.path.abspath(inp):
            raise ConversionError(f"{out}: this file is one of the inputs; choose another file name")
        raise ConversionError(f"{out}: links to {inp}, which is one of the inputs; choose another file name")


def check_output_path(out: Path) -> None:
    """Raise ConversionError when `out` cannot be a file name to write: a folder, or in a folder that is missing."""
    out = Path(out)
    if out.is_dir():
        raise ConversionError(f"{out}: is a directory; give a file name for the output")
    if not out.parent.is_dir():
        raise ConversionError(f"{out}: folder {out.parent} does not exist; create it first")


def temp_path(out: Path) -> Path:
    """The temp file a writer fills before renaming it to `out`: hidden, beside it (same filesystem), per process."""
    out = Path(out)
    return out.with_name(f".{out.name}.{os.getpid()}.tmp")


def write_error(out: Path, e: OSError) -> ConversionError:
    """The one-line error for an OS failure writing `out`: it names the output folder (absolute: "." would say
    little) and the OS reason."""
    folder = Path(out).absolute().parent
    return ConversionError(f"cannot write to {folder}: {e.strerror or e} ({Path(out).name} was not written)")


_PROBE_BYTES = 1 << 20  # more than any write buffer: a disk that filled up cannot hide it in the slack


def output_problem(tmp: Path) -> OSError | None:
    """After a write to the temp file `tmp` failed without saying why: the OS error its folder gives now, or None
    if it takes data.

    Appending a probe to the temp file (still there, holding what was written) reproduces the reason: a full disk
    refuses it with ENOSPC, a quota with EDQUOT. A temp file that vanished is also the output's fault, and so is a
    folder with no free blocks left.
    """
    try:
        with open(tmp, "r+b") as f:  # r+: a vanished temp file is an error here, not silently recreated
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e
    if os.statvfs(Path(tmp).parent).f_bavail == 0:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def remove_quietly(path: Path) -> None:
    """Delete `path` if it is there. Errors are ignored: on a read-only or vanished folder there is nothing to
    delete, and a cleanup must not replace the error that caused it."""
    try:
        os.unlink(path)
    except OSError:
        pass


@contextmanager
def temp_output(out: Path) -> Iterator[Path]:
    """Yield the temp path to write `out` through; rename it to `out` when the body completes.

    Contract: `out` is checked (`check_output_path`) and the temp file created empty before the body runs, so an
    unwritable folder fails at once. On any exception, Ctrl-C, SIGTERM or SIGHUP the temp file is removed and `out`
    is left as it was. An OSError from writing (read-only or full filesystem, no permission) becomes one
    ConversionError naming the output folder and the OS reason; an OSError about another file (`filename` set to
    something else: an input that cannot be read) passes unchanged. SIGTERM/SIGHUP end the process after the
    cleanup (see `ending_signals_raise`).
    """
    out = Path(out)
    check_output_path(out)
    tmp = temp_path(out)
    with ending_signals_raise():
        try:
            open(tmp, "wb").close()  # fail now, with the OS's reason, if the folder cannot take a file
            yield tmp
            os.replace(tmp, out)
        except OSError as e:
            if e.filename is not None and str(e.filename) not in (str(tmp), str(out)):
                remove_quietly(tmp)
                raise
            # numpy reports a short write as "N requested and M written", without errno: ask the folder why
            reason = e if e.errno is not None else (output_problem(tmp) or e)
            remove_quietly(tmp)
            raise write_error(out, reason) from e
        except BaseException:
            remove_quietly(tmp)
            raise


# --- SIGTERM and SIGHUP ---------------------------------------------------------------------------------------

# Signals whose default action kills the process on the spot, with no Python cleanup: a writer turns them into an
# exception while its temp file exists (SIGHUP does not exist on Windows).
ENDING_SIGNALS: tuple[signal.Signals, ...] = tuple(
    s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None
)


class Terminated(BaseException):
    """Raised in the main thread when SIGTERM or SIGHUP arrives during a write; `signum` is the signal.

    A BaseException, like KeyboardInterrupt, so that `except Exception` blocks do not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _RaiseTerminated:
    """The handler `ending_signals_raise` installs: raise Terminated once; repeats are ignored, so that a second
    SIGTERM cannot cut the cleanup of the first short."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, signum: int, frame: object) -> None:
        if not self.fired:
            self.fired = True
            raise Terminated(signum)


def takes_default_action(signum: int) -> bool:
    """Whether `signum` would end the process without cleanup: its handler is the default (SIG_DFL), or the one
    `ending_signals_raise` installed. A handler someone else installed, or SIG_IGN (nohup), is theirs to keep."""
    handler = signal.getsignal(signum)
    return handler == signal.SIG_DFL or isinstance(handler, _RaiseTerminated)


def exit_code(signum: int) -> int:
    """The shell's exit status for a process ended by `signum`: 128 + its number (143 for SIGTERM)."""
    return 128 + int(signum)


@contextmanager
def ending_signals_raise() -> Iterator[None]:
    """While the body runs, SIGTERM and SIGHUP raise Terminated in it, so its cleanup runs; then the process ends.

    Only on the main thread (the only one Python delivers signals to) and only for signals with the default action
    (`takes_default_action`); the previous handlers come back when the body ends. When Terminated leaves the body,
    "terminated" is printed on stderr and SystemExit(128 + signal) raised: the status a shell reports for a process
    the signal killed, without a traceback (click and the interpreter pass SystemExit through).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _RaiseTerminated()
    previous = {s: signal.getsignal(s) for s in ENDING_SIGNALS if takes_default_action(s)}
    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    except Terminated as e:
        sys.stderr.write("\nterminated\n")
        sys.stderr.flush()
        raise SystemExit(exit_code(e.signum)) from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
