"""KV cache types llama.cpp accepts (its --cache-type-k/-v); all but the unquantized need flash attention. `kv_label`
spells a K/V pair.

Apart from decoder.py so that the command line can offer them without importing llama.cpp."""

UNQUANTIZED_KV = ("f16", "bf16", "f32")
KV_TYPES = (*UNQUANTIZED_KV, "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")


def kv_label(k: str, v: str) -> str:
    """A K/V cache pair as users read it: "q8_0", or "q8_0/f16" where the two differ."""
    return k if k == v else f"{k}/{v}"
