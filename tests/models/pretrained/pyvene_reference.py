"""pyvene's interchange interventions on a Hugging Face model, as the oracle of the grid's cells
on the model mecheval converts from it.

mecheval's block sites map to the Hugging Face modules' inputs and outputs, in pyvene's
component names: block_input / block_output -> the block's input / output ("block_input",
"block_output"), mixer_input / mixer_output -> the attention's (or mixer's) input / output
("attention_input", "attention_output"), mlp_input / mlp_output -> the MLP's ("mlp_input",
"mlp_output"). pyvene maps GPT-2 and Llama itself; for Mamba, Mamba-2 and fla's models, which it
does not know, `register` adds their module paths through pyvene's own tables (as its docs add a
model). The recurrent state (site "state") lies inside a fused scan: no module hook reaches it,
so pyvene has no cell for it.
"""

from __future__ import annotations

import contextlib

import pyvene as pv
import torch
import torch.nn.functional as F
from pyvene.models.constants import CONST_INPUT_HOOK, CONST_OUTPUT_HOOK
from pyvene.models.intervenable_modelcard import type_to_dimension_mapping, type_to_module_mapping

from mecheval.interventions.positions import resolve_position

COMPONENTS = {
    "block_input": "block_input",
    "mixer_input": "attention_input",
    "mixer_output": "attention_output",
    "mlp_input": "mlp_input",
    "mlp_output": "mlp_output",
    "block_output": "block_output",
}


def register(hf_model) -> None:
    """Add a Mamba, Mamba-2 or fla model's module paths to pyvene's tables (GPT-2 and Llama
    are pyvene's own)."""
    kind = type(hf_model)
    if kind in type_to_module_mapping:
        return
    family = hf_model.config.model_type
    base, mixer = ("backbone", "mixer") if family in ("mamba", "mamba2") else ("model", "attn")
    block = f"{base}.layers[%s]"
    modules = {
        "block_input": (block, CONST_INPUT_HOOK),
        "block_output": (block, CONST_OUTPUT_HOOK),
        "attention_input": (f"{block}.{mixer}", CONST_INPUT_HOOK),
        "attention_output": (f"{block}.{mixer}", CONST_OUTPUT_HOOK),
    }
    if base == "model":  # fla's blocks have an MLP
        modules["mlp_input"] = (f"{block}.mlp", CONST_INPUT_HOOK)
        modules["mlp_output"] = (f"{block}.mlp", CONST_OUTPUT_HOOK)
    type_to_module_mapping[kind] = modules
    type_to_dimension_mapping[kind] = {name: ("hidden_size",) for name in modules}


@torch.no_grad()
def pyvene_cells(hf_model, batch, corrupted, layer: int, site: str, labels, context=None):
    """label -> (p_restored, logit_restored, kl) per document: pyvene's vanilla interchange
    intervention at (layer, site, the label's position in each document), sources the
    documents, bases the corrupted ones, read at each document's query. `context`: a context
    manager factory the runs go inside (fla's naive forwards on CPU)."""
    register(hf_model)
    config = {"layer": layer, "component": COMPONENTS[site]}
    model = pv.IntervenableModel(
        {**config, "intervention_type": pv.VanillaIntervention}, model=hf_model
    )
    rows, query, answers = torch.arange(len(batch)), batch.positions["query"], batch.answers
    out = {}
    with context() if context else contextlib.nullcontext():
        clean = hf_model(batch.tokens, use_cache=False).logits[rows, query]
        log_clean = F.log_softmax(clean.float(), -1)
        for label in labels:
            where = [[[int(p)] for p in resolve_position(label, batch)]]
            _, patched = model(
                base={"input_ids": corrupted, "use_cache": False},
                sources=[{"input_ids": batch.tokens, "use_cache": False}],
                unit_locations={"sources->base": (where, where)},
            )
            logits = patched.logits[rows, query].float()
            log_p = F.log_softmax(logits, -1)
            kl = (log_clean.exp() * (log_clean - log_p)).sum(-1)
            out[label] = (log_p[rows, answers].exp(), logits[rows, answers], kl)
    return out
