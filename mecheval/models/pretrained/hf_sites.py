"""Where mecheval's block sites lie in the Hugging Face model a PretrainedModel is converted from:
the module whose input or output holds the same activation, for hooks of one's own (a plain
hook loop, pyvene) on that model.

    hf_site("gpt2", 3, "mixer_output")   ->  ("transformer.h.3.attn", "output")
    hf_site("mamba", 0, "block_input")   ->  ("backbone.layers.0", "input")

A module's input is its first positional argument (or its first keyword argument where it is
called by keyword, as Llama's attention is); its output is the tensor it returns, or the first
element of the tuple it returns (attention's, fla's blocks'). The sites inside a mixer (the
recurrent state, a convolution's input) have no module of their own there: a scan's state is out
of a hook's reach.
"""

from __future__ import annotations

# family -> (the blocks' module list, the mixer's attribute, the MLP's attribute or None)
HF_BLOCKS = {
    "gpt2": ("transformer.h", "attn", "mlp"),
    "llama": ("model.layers", "self_attn", "mlp"),
    "mamba": ("backbone.layers", "mixer", None),
    "mamba2": ("backbone.layers", "mixer", None),
    "delta_net": ("model.layers", "attn", "mlp"),
    "gated_deltanet": ("model.layers", "attn", "mlp"),
}
BLOCK_SITES = ("block_input", "mixer_input", "mixer_output", "mlp_input", "mlp_output")
BLOCK_SITES += ("block_output",)


def hf_site(family: str, layer: int, site: str) -> tuple[str, str]:
    """(module path, "input" or "output") of block site `site` of layer `layer` in a Hugging
    Face model of `family`; ValueError for a site with no module there."""
    if family not in HF_BLOCKS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(HF_BLOCKS)}")
    blocks, mixer, mlp = HF_BLOCKS[family]
    block = f"{blocks}.{layer}"
    places = {
        "block_input": (block, "input"),
        "block_output": (block, "output"),
        "mixer_input": (f"{block}.{mixer}", "input"),
        "mixer_output": (f"{block}.{mixer}", "output"),
    }
    if mlp is not None:
        places["mlp_input"] = (f"{block}.{mlp}", "input")
        places["mlp_output"] = (f"{block}.{mlp}", "output")
    if site not in places:
        raise ValueError(
            f"site {site!r} has no module of its own in a {family} model (its block sites: "
            f"{', '.join(places)})"
        )
    return places[site]
