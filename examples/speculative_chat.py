"""Stream a chat answer with a draft model and print the stats line.

    python examples/speculative_chat.py TARGET.gguf DRAFT.gguf "Why is the sky blue?"
"""

import sys

from ggufspec import GenerationSettings, SpeculativeEngine

target, draft, question = sys.argv[1], sys.argv[2], sys.argv[3]
with SpeculativeEngine.load(target, draft) as engine:
    for r in engine.stream([{"role": "user", "content": question}], GenerationSettings(max_tokens=200)):
        print(r.text, end="", flush=True)
    print()
    print(r.result.stats.line(), file=sys.stderr)
