"""Medusa heads (Cai et al. 2024): everything but the decoding method itself (`ggufspec.methods.medusa`).

heads.py: a head set at run time (its GGUF layout and reader, the ResBlocks, proposing top-k tokens);
candidates.py: a restricted candidate vocabulary; train.py: collecting a target's hidden states and fitting
heads to them; fit.py: fitting a candidate tree to trained heads; cli.py: the `ggufspec medusa` commands.
Conversion of FasterDecoding checkpoints to GGUF is in `ggufspec.convert.medusa`; the candidate trees
themselves in `ggufspec.trees`.
"""
