"""Medusa heads (Cai et al. 2024): everything but the decoding method itself (`ggufspec.methods.medusa`).

format.py: ggufspec's Medusa GGUF (layout, writer, reader); heads.py: a head set at run time (the ResBlocks,
proposing top-k tokens); candidates.py: a restricted candidate vocabulary; train.py: collecting a target's hidden
states and fitting heads to them; checkpoint.py: writing heads as a FasterDecoding checkpoint; fit.py: fitting a
candidate tree to trained heads; cli.py: the `ggufspec medusa` commands.

Layering: nothing here imports `ggufspec.convert` or `ggufspec.cli`; conversion of FasterDecoding checkpoints
(`ggufspec.convert.medusa`) builds on format.py. The candidate trees themselves are in `ggufspec.trees`.
"""
