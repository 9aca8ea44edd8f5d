"""Writing Medusa heads as a FasterDecoding checkpoint (`medusa train --checkpoint-dir`), the form the Medusa
authors' code loads; ggufspec itself reads heads from GGUF (`format.py`), and `convert medusa` turns such a
checkpoint into one. No llama.cpp here: `medusa train` names these files before it loads the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..outputs import temp_output

WEIGHTS_FILE = "medusa_lm_head.safetensors"
CONFIG_FILE = "config.json"
CHECKPOINT_FILES = (WEIGHTS_FILE, CONFIG_FILE)  # everything save_checkpoint writes into its folder


def save_checkpoint(
    out_dir: Path, res: list[list[tuple[np.ndarray, np.ndarray]]], lm_heads: list[np.ndarray] | None = None,
    base_model: str = "", vocab_size: int = 0, choices: list[list[int]] | None = None,
) -> Path:
    """Write a FasterDecoding checkpoint into `out_dir` (created if missing) and return it: medusa_lm_head.safetensors
    (float32 {i}.{j}.linear.weight|bias, and {i}.{L}.weight for v1 heads' own LM heads) + config.json (with
    `medusa_choices`, the candidate tree fitted to the heads, when given). Each file is written atomically."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for i, blocks in enumerate(res):
        for j, (w, b) in enumerate(blocks):
            tensors[f"{i}.{j}.linear.weight"] = np.ascontiguousarray(w, dtype=np.float32)
            tensors[f"{i}.{j}.linear.bias"] = np.ascontiguousarray(b, dtype=np.float32)
        if lm_heads is not None:
            tensors[f"{i}.{len(blocks)}.weight"] = np.ascontiguousarray(lm_heads[i], dtype=np.float32)
    with temp_output(out_dir / WEIGHTS_FILE) as tmp:  # no half-written checkpoint on failure
        save_file(tensors, str(tmp))
    config = {
        "medusa_num_heads": len(res), "medusa_num_layers": len(res[0]) if res else 0,
        "version": 1 if lm_heads is not None else 2, "base_model_name_or_path": base_model,
        "hidden_size": int(res[0][0][0].shape[0]) if res and res[0] else 0, "vocab_size": vocab_size,
    }
    if choices is not None:
        config["medusa_choices"] = choices
    with temp_output(out_dir / CONFIG_FILE) as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir
