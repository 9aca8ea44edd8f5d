"""Medusa heads (Cai et al. 2024): everything but the decoding method itself (`ggufspec.methods.medusa`).

heads.py: a head set at run time (read from GGUF, proposing top-k tokens); train.py: collecting a target's
hidden states and fitting heads to them; cli.py: the `ggufspec medusa` commands. Conversion of
FasterDecoding checkpoints to GGUF is in `ggufspec.convert.medusa`; the candidate trees in `ggufspec.trees`.
"""
