"""Random checkpoints and documents, built offline: what the tests, the benchmark and a user
without weights run the pretrained path on.

    hf_model = random_hf_model("mamba", d_model=64, n_layers=2)   # a transformers model object
    model = from_pretrained(hf_model)
    batch, corrupted = random_batch(model.config.vocab_size, n=8, length=24)
    interchange_grid(model, batch, corrupted)

`random_hf_model` builds the family's Hugging Face model from a config (no download) and moves
every weight off its initial value (norms off one, biases off zero), so that a conversion that
misplaces a weight shows in the logits. `random_batch` makes recall-shaped documents of random
tokens: a key and its value somewhere, the key again at the query, the value the answer.
`word_tokenizer` and `bpe_tokenizer` save tokenizers built here (a word per id; byte-level BPE
trained on a few sentences) as transformers saves a checkpoint's, for the `prompts` task:

    folder = word_tokenizer("The code of Alice Bob is 12 47 .".split(), tmp_path)
    random_hf_model("gpt2", vocab_size=len(words) + 1).save_pretrained(folder)
    # mecheval evaluate --model hf:FOLDER --task prompts.yaml (tokenizer: the folder's)
"""

from __future__ import annotations

import torch

from mecheval.tasks import Batch

# family -> (module, config class, model class)
CLASSES = {
    "gpt2": ("transformers", "GPT2Config", "GPT2LMHeadModel"),
    "llama": ("transformers", "LlamaConfig", "LlamaForCausalLM"),
    "mamba": ("transformers", "MambaConfig", "MambaForCausalLM"),
    "mamba2": ("transformers", "Mamba2Config", "Mamba2ForCausalLM"),
    "delta_net": ("fla.models", "DeltaNetConfig", "DeltaNetForCausalLM"),
    "gated_deltanet": ("fla.models", "GatedDeltaNetConfig", "GatedDeltaNetForCausalLM"),
}


def _sizes(family: str, d: int, n: int) -> dict:
    """The config keywords of a model of `family` of width d and n layers (heads of 16)."""
    heads = max(1, d // 16)
    fused = {"fuse_norm": False, "fuse_swiglu": False, "fuse_cross_entropy": False}
    return {
        "gpt2": {"n_embd": d, "n_layer": n, "n_head": heads},
        "llama": {
            "hidden_size": d,
            "intermediate_size": 3 * d,
            "num_hidden_layers": n,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "tie_word_embeddings": False,
        },
        "mamba": {"hidden_size": d, "num_hidden_layers": n, "state_size": 16},
        "mamba2": {
            "hidden_size": d,
            "num_hidden_layers": n,
            "state_size": 16,
            "head_dim": 16,
            "num_heads": 2 * d // 16,
            "n_groups": 1,
            "chunk_size": 64,
        },
        "delta_net": {"hidden_size": d, "num_hidden_layers": n, "num_heads": heads, **fused},
        "gated_deltanet": {
            "hidden_size": d,
            "num_hidden_layers": n,
            "num_heads": heads,
            "head_dim": d // heads,
            "expand_v": 1.0,
            **fused,
        },
    }[family]


def random_hf_model(
    family: str,
    *,
    d_model: int = 32,
    n_layers: int = 2,
    vocab_size: int = 97,
    seed: int = 0,
    scale: float = 0.2,
    **config: object,
):
    """A transformers (or fla) causal LM of `family` with random weights, in eval mode.

    Args:
        family: one of mecheval.models.pretrained.FAMILIES.
        d_model, n_layers, vocab_size: its sizes (heads of 16 channels).
        seed: the seed of its weights.
        scale: every weight is moved by N(0, scale^2) from its initial value.
        config: more keywords of the family's config class (they win over the defaults).
    """
    import importlib

    if family not in CLASSES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(CLASSES)}")
    module, config_class, model_class = CLASSES[family]
    classes = importlib.import_module(module)
    ids = {"vocab_size": vocab_size, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    hf_config = getattr(classes, config_class)(
        **{**_sizes(family, d_model, n_layers), **ids, **config}
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(classes, model_class)(hf_config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * scale)
    return model.eval()


def random_batch(vocab_size: int, n: int = 6, length: int = 16, seed: int = 0):
    """(documents, corrupted tokens): n recall-shaped documents of `length` random ids in
    1..vocab_size - 1, each with a key at a random position k in 1..length - 5, its value at
    k + 1, the key again at the query (length - 2, after the divider at length - 3) and the
    value as the answer (at length - 1); the corruption puts another key at k.

    Returns:
        a mecheval.tasks.Batch and its corruption (n, length).
    """
    if length < 7 or vocab_size < 3:
        raise ValueError(
            f"random_batch needs length >= 7 and vocab_size >= 3, got {length}, {vocab_size}"
        )
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab_size, (n, length), generator=g)
    rows = torch.arange(n)
    key = torch.randint(1, length - 4, (n,), generator=g)
    query = torch.full((n,), length - 2)
    tokens[rows, query] = tokens[rows, key]
    tokens[rows, query + 1] = tokens[rows, key + 1]
    positions = {"key": key, "value": key + 1, "divider": query - 1, "query": query}
    positions["answer"] = query + 1
    batch = Batch(tokens, tokens[rows, query + 1], positions, torch.full((n,), length))
    corrupted = tokens.clone()
    shift = torch.randint(1, vocab_size - 1, (n,), generator=g)
    corrupted[rows, key] = (tokens[rows, key] - 1 + shift) % (vocab_size - 1) + 1
    return batch, corrupted


def _save_tokenizer(backend, folder, **special: str):
    """Save a `tokenizers.Tokenizer` in `folder` as transformers does (tokenizer.json,
    tokenizer_config.json); returns the folder."""
    from pathlib import Path

    import transformers

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    fast.save_pretrained(folder)
    return Path(folder)


def word_tokenizer(words, folder):
    """A tokenizer of one id per word of `words` (ids 1.. in sorted order, <unk> 0), split at
    spaces and punctuation, saved in `folder` (returned); its vocabulary: len(set(words)) + 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(sorted(set(words)))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return _save_tokenizer(backend, folder, unk_token="<unk>")


def bpe_tokenizer(sentences, folder, vocab_size: int = 300):
    """A byte-level BPE tokenizer (as GPT-2's: a leading space joins the word after it) trained
    on `sentences`, vocabulary at most `vocab_size` (id 0: <|endoftext|>), saved in `folder`
    (returned)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(list(sentences), trainer=trainer)
    return _save_tokenizer(backend, folder, eos_token="<|endoftext|>")
