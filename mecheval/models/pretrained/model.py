"""`PretrainedModel`: a `LanguageModel` assembled from a pretrained checkpoint's parts, and the
`PretrainedConfig` that describes it.

It is a LanguageModel in every respect the interventions use (`embed`, `forward_from`,
`resume_from`, `intervene`, the sites, `unembedding`), with the checkpoint's own embedding,
blocks, final norm and output head (untied where the checkpoint has its own). Build one with
`mecheval.models.from_pretrained`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mecheval.checks import check_int
from mecheval.models.language_model import LanguageModel

# The families from_pretrained reads, by the model_type of their checkpoints' config.json.
FAMILIES = ("gpt2", "llama", "mamba", "mamba2", "delta_net", "gated_deltanet")


@dataclass(frozen=True)
class PretrainedConfig:
    """What a pretrained model is: its family and source, and its sizes (named as ModelConfig's
    fields, which the grid and the models' checks read).

    Attributes:
        family: the checkpoint's model_type, one of FAMILIES.
        source: the folder or hub id it was loaded from, or the class of the model object.
        vocab_size: rows of the embedding (and of the output head).
        d_model: width of the residual stream.
        n_layers: blocks.
        max_len: longest sequence the model accepts (GPT-2's position embeddings, Llama's
            max_position_embeddings; recurrent models have no limit of their own and take
            `UNBOUNDED`).
        tied: whether the output head is the embedding's matrix.
    """

    family: str
    source: str
    vocab_size: int
    d_model: int
    n_layers: int
    max_len: int
    tied: bool

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; known: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "d_model", "n_layers", "max_len"):
            check_int(name, getattr(self, name), 1)

    @property
    def arch(self) -> str:
        """The family, as error messages name a model's architecture."""
        return self.family


# A recurrent model's max_len: it has no limit of its own (2^20 tokens).
UNBOUNDED = 1 << 20


class PretrainedModel(LanguageModel):
    """A LanguageModel of a checkpoint's parts (see the module docstring).

    Args:
        config: the model's `PretrainedConfig`.
        embedding: the token embedding, (vocab_size, d_model).
        layers: the blocks (mecheval.models.blocks), in order.
        norm_f: the final norm.
        lm_head: the output head when it is not tied to the embedding (a Linear without bias,
            (vocab_size, d_model)); None when it is.
        position_embedding: learned absolute position embeddings (GPT-2's), (max_len, d_model).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        embedding: nn.Embedding,
        layers: list[nn.Module],
        norm_f: nn.Module,
        lm_head: nn.Linear | None = None,
        position_embedding: nn.Embedding | None = None,
    ) -> None:
        nn.Module.__init__(self)  # the parts are given: LanguageModel's constructor builds its own
        self.config = config
        self.embedding = embedding
        self.position_embedding = position_embedding
        self.layers = nn.ModuleList(layers)
        self.norm_f = norm_f
        self.lm_head = lm_head
        if lm_head is not None and lm_head.bias is not None:
            raise ValueError("the output head must have no bias (the grid's metrics assume none)")
        self._index_sites()

    @property
    def unembedding(self) -> torch.Tensor:
        """The head's (vocab_size, d_model) matrix: the output head's, or the embedding's where
        they are tied. Logits are the final norm's output times its transpose."""
        return self.embedding.weight if self.lm_head is None else self.lm_head.weight
