"""Pretrained language models under mecheval's lens: `from_pretrained` builds a mecheval model
(a `PretrainedModel`, a LanguageModel with the same sites, interventions and grids as the zoo's)
from a Hugging Face checkpoint of transformers' GPT-2, Llama, Mamba and Mamba-2 and of
flash-linear-attention's DeltaNet and Gated DeltaNet.

    model = from_pretrained("openai-community/gpt2")       # a hub id (downloaded), or
    model = from_pretrained("/data/gpt2")                   # a folder: config.json + weights, or
    model = from_pretrained(hf_model)                       # a transformers model object
    model(tokens)                                           # logits, as transformers' own
    hf_site("gpt2", 3, "mixer_output")                      # where a site lies in theirs

Mamba's, Mamba-2's, DeltaNet's and Gated DeltaNet's blocks run mecheval's layers, so the grid
reads and patches their recurrent state inside mecheval's scans (site "state"). docs/pretrained.md
says what is checked and how.
"""

from mecheval.models.pretrained.families import convert, family_of
from mecheval.models.pretrained.hf_sites import hf_site
from mecheval.models.pretrained.load import from_pretrained
from mecheval.models.pretrained.model import (
    FAMILIES,
    UNBOUNDED,
    PretrainedConfig,
    PretrainedModel,
)

__all__ = [
    "FAMILIES",
    "UNBOUNDED",
    "PretrainedConfig",
    "PretrainedModel",
    "convert",
    "family_of",
    "from_pretrained",
    "hf_site",
]
