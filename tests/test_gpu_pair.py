"""scripts/gpu_pair.py, the GPU check's target maker: x R wide and x K deep, the source's function at R^2 K its cost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import open_decoder

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(os.environ.get("GGUFSPEC_SHARED") or REPO.parent / "shared") / "tools"


@pytest.mark.skipif(not (TOOLS / "widen_gguf.py").exists(), reason=f"no widen_gguf.py in {TOOLS}")
def test_the_target_computes_its_sources_function(tiny_target, tmp_path) -> None:
    out = tmp_path / "wide-deep.gguf"
    subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_pair.py"), str(tiny_target), str(out), "--widen", "2",
                    "--deepen", "3", "--type", "f16", "--tools", str(TOOLS)], check=True, capture_output=True)
    src, dst = gguf.GGUFReader(tiny_target), gguf.GGUFReader(out)
    assert dst.fields["llama.block_count"].contents() == 3 * src.fields["llama.block_count"].contents()
    assert dst.fields["llama.embedding_length"].contents() == 2 * src.fields["llama.embedding_length"].contents()
    copy = {t.name: t.data for t in dst.tensors if t.name.startswith("blk.1.")}  # layer 0's first copy
    assert not copy["blk.1.attn_output.weight"].any() and not copy["blk.1.ffn_down.weight"].any()
    assert copy["blk.1.ffn_up.weight"].any()  # a real layer's reads and work, adding nothing
    with open_decoder(tiny_target) as a, open_decoder(out) as b:
        tokens = a.vocab.tokenize("The capital of France is")
        want, got = a.feed(tokens), b.feed(tokens)
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()  # F16 weights: rounding only
    assert (got.argmax(-1) == want.argmax(-1)).all()
