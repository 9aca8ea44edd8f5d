#!/usr/bin/env bash
# Medusa heads for SmolLM2-135M-Instruct (the demo target), as shipped in models/demo/ (2026-11-23).
# Run from the repository root. Prompts are made by the draft recipe (scripts/recipes/draft_data.py), none
# from the benchmark sets; the same answers serve the demo draft's distillation.
set -euo pipefail
TARGET=${TARGET:-.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p .cache/data .cache/medusa
# 1. the target's greedy answers with hidden states and top-16 logits, two shards side by side (~1.5 h on 2 idle cores)
for s in 0 1; do
  nice -n 19 python scripts/recipes/draft_data.py "$TARGET" .cache/data/d10_$s.npz --minutes 300 --seed 10 \
      --shard $s/2 --n-seq 32 --threads 1 --per-topic 12 --docs 600 --self-prompts 300 --save-every 10 --hidden &
done
wait
# 2. answers only, in medusa train's --data format
python scripts/medusa/hidden_from_sequences.py "$TARGET" .cache/medusa/d10.npz .cache/data/d10_0.npz .cache/data/d10_1.npz
# 3. 4 v2 heads, one ResBlock each, 3 epochs; a 63-node tree fitted on held-out answers is stored with them
OPENBLAS_NUM_THREADS=1 ggufspec medusa train "$TARGET" models/demo/smollm2-135m-instruct-medusa.gguf \
    --data .cache/medusa/d10.npz --heads 4 --epochs 3 --batch 256 --lr 1e-3 --checkpoint-dir .cache/medusa/checkpoint
# 4. mean accepted length per category on shared/bench prompts (temperature 0, the heads' own tree)
python scripts/medusa/eval_acceptance.py "$TARGET" models/demo/smollm2-135m-instruct-medusa.gguf \
    --per-category 3 --max-new 128 --data .cache/medusa/bench3.npz
