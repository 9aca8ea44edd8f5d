"""Ctrl-C while llama.cpp itself works (loading a model, a long prefill): exit 130 at once, no traceback, no text.

Python runs its Ctrl-C handler at the next Python code of the main thread, which during a llama.cpp call is a log
or progress callback, where the KeyboardInterrupt used to be dropped ("Exception ignored") and the run went on.
Each test waits for llama.cpp's own log (-v) to show it is in the middle of the work before sending the signal, and
asserts on llama.cpp's own words that the work was cut short, so a run that finished first cannot pass.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

ROOT = Path(__file__).resolve().parents[1]


def spawn(*args: object) -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "ggufspec.cli", *map(str, args)], cwd=ROOT, encoding="utf-8",
                         timeout=120, dimensions=(50, 300))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_ctrl_c_while_the_model_loads_stops_the_load(smollm2_path, command: str) -> None:
    args = (["generate", "-m", smollm2_path, "-n", "16", "--stats", "Tell me a story."] if command == "generate"
            else ["serve", "-m", smollm2_path, "--port", "0"])
    child = spawn(*args, "-v")
    child.expect("loaded meta data")  # llama.cpp's loader has started; the tensors come next
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    out = child.before
    assert child.exitstatus == 130, out[-2000:]
    assert "cancelled model load" in out  # llama.cpp's word: the progress callback stopped it
    assert "Traceback" not in out and "Exception ignored" not in out, out[-2000:]
    assert out.rstrip().endswith("interrupted")
    assert "serving" not in out and "generated" not in out


def test_ctrl_c_during_a_long_prefill_aborts_the_batch(smollm2_path, tmp_path: Path) -> None:
    # ~4,900 prompt tokens in one llama.cpp batch: many seconds on 2 cores, so the signal lands inside llama_decode
    prompt = " ".join(f"word{i}" for i in range(1200))
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ggufspec.cli", "generate", "-m", str(smollm2_path), "-n", "4",
                                 "-c", "8192", "--n-batch", "8192", "--raw", "-v", prompt],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        end = time.monotonic() + 120
        while "sched_reserve: reserve took" not in err_path.read_text():  # the context is made: the prefill starts
            assert proc.poll() is None and time.monotonic() < end, err_path.read_text()[-2000:]
            time.sleep(0.05)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    log = err_path.read_text()
    assert proc.returncode == 130, log[-2000:]
    assert "failed to decode, ret = 2" in log  # llama.cpp's word: the abort check stopped the batch midway
    assert "Traceback" not in log and "Exception ignored" not in log
    assert out.strip() == ""
