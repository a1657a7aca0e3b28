"""What the pretrained models' tests share: the reference logits of a Hugging Face model object
(transformers' own forward; for fla's models, fla's model with its layers' naive forwards,
fla_reference.py) and the largest gap between them and ours."""

from __future__ import annotations

import torch

from tests.models.pretrained.fla_reference import fla_logits

FLA = ("delta_net", "gated_deltanet")
# The logits' parity in float32 (the bar) against transformers' own forward.
LOGITS_ATOL = 1e-5
# Against fla's naive recurrences, in float32 themselves: on Gated DeltaNet without its output
# gate, whose RMSNorm of the delta rule's output amplifies rounding, they stand 1.6e-5 from a
# float64 recurrence, ours 2.5e-5, 1.05e-5 apart (seed 0, 24 tokens).
FLA_LOGITS_ATOL = 2e-5


def parity_bar(family: str) -> float:
    return FLA_LOGITS_ATOL if family in FLA else LOGITS_ATOL


@torch.no_grad()
def reference_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    if hf_model.config.model_type in FLA:
        return fla_logits(hf_model, tokens)
    return hf_model(tokens, use_cache=False).logits


@torch.no_grad()
def logits_gap(hf_model, model, length: int = 24, n: int = 3, seed: int = 0) -> float:
    """max |ours - theirs| over the logits of n random sequences of `length` tokens (and the
    theirs' largest logit, which the gap is small beside, is checked to be over 1)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (n, length), generator=g)
    theirs = reference_logits(hf_model, tokens)
    assert theirs.abs().max() > 1.0  # weights far enough from their init to show a misplaced one
    return float((model(tokens) - theirs).abs().max())
