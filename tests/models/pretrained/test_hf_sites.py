"""hf_site (mecheval/models/pretrained/hf_sites.py): a forward hook on the Hugging Face module it
names sees, for every block site of every family, the activation our model's site reads."""

from __future__ import annotations

import pytest
import torch

from mecheval.models.pretrained import FAMILIES, from_pretrained
from mecheval.models.pretrained.hf_sites import BLOCK_SITES, hf_site
from mecheval.models.pretrained.synthetic import random_hf_model
from tests.models.pretrained.fla_reference import naive_forwards
from tests.models.pretrained.helpers import FLA


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _hooked(hf, path: str, where: str, tokens) -> torch.Tensor:
    seen = []
    module = hf.get_submodule(path)
    if where == "input":
        hook = lambda m, args, kwargs: seen.append(args[0] if args else next(iter(kwargs.values())))  # noqa: E731
        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    else:
        handle = module.register_forward_hook(lambda m, i, out: seen.append(_first(out)))
    try:
        hf(tokens, use_cache=False)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_hooks_see_our_sites(family):
    hf = random_hf_model(family, seed=5)
    model = from_pretrained(hf)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    sites = [s for s in BLOCK_SITES if f"layers.1.{s}" in model.site_names()]
    with model.intervene(reads={f"layers.1.{s}": None for s in sites}) as record:
        model(tokens)
    for site in sites:
        with naive_forwards(hf) if family in FLA else torch.no_grad():
            theirs = _hooked(hf, *hf_site(family, 1, site), tokens)
        torch.testing.assert_close(record[f"layers.1.{site}"], theirs, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="site 'state' has no module of its own"):
        hf_site(family, 0, "state")
