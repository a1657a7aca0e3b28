"""`from_pretrained`: a checkpoint from a folder, the Hugging Face hub or a model object, read by
transformers (flash-linear-attention's families through fla's classes) and converted.

A folder holds config.json and the weights (model.safetensors, pytorch_model.bin, or their
sharded index). A hub id is downloaded with `huggingface_hub` into its cache (config, weights,
tokenizer files). What is missing (the folder, its weights, the network, a package) is said in
one line, a ValueError naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mecheval.models.pretrained.families import check, convert
from mecheval.models.pretrained.model import PretrainedModel

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# What a hub download fetches: configs, weights in safetensors, tokenizer files; *.bin only for
# a repository without safetensors.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model"]
FLA_TYPES = ("delta_net", "gated_deltanet")


def from_pretrained(
    source,
    *,
    dtype: torch.dtype = torch.float32,
    max_len: int | None = None,
    revision: str | None = None,
) -> PretrainedModel:
    """A mecheval model of a pretrained checkpoint (mecheval.models.pretrained).

    Args:
        source: a folder holding config.json and the weights; a Hugging Face hub id
            ("openai-community/gpt2", "state-spaces/mamba-130m-hf"; an "hf:" prefix is
            allowed), downloaded to the hub's cache unless it is there; or a transformers
            model object (GPT2LMHeadModel, ...), converted as it is (its dtype and device),
            whose tensors the model then shares.
        dtype: the parameters' dtype for a folder or hub id (float32 by default: the grid's
            and the checks' precision).
        max_len: longest sequence to accept (default: the checkpoint's own limit).
        revision: the hub revision (a branch, tag or commit) for a hub id.

    Returns:
        the model, in eval mode.
    """
    if not isinstance(source, (str, os.PathLike)):
        return convert(source, max_len=max_len)
    name = str(source).removeprefix("hf:")
    folder = checkpoint_folder(name, revision)
    config = _config(folder, name)
    check(config, name)
    hf_model = _hf_model(folder, config, name, dtype)
    return convert(hf_model, name, max_len)


def _looks_like_path(name: str) -> bool:
    """A name no hub id has (hub ids are "name" or "owner/name")."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1


def checkpoint_folder(source: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder of a checkpoint (a folder, or a hub id, an "hf:" prefix allowed):
    itself, or its download in the hub's cache (downloaded unless it is there), checked to
    hold config.json and weights (a ValueError says what is missing)."""
    name = str(source).removeprefix("hf:")
    path = Path(name).expanduser()
    if path.is_file():
        raise ValueError(f"{name} is a file: pass the folder that holds config.json and weights")
    if not path.is_dir():
        if _looks_like_path(name):
            raise ValueError(f"no folder {name} (a checkpoint is a folder: config.json + weights)")
        path = _download(name, revision)
    if not (path / "config.json").is_file():
        raise ValueError(f"{name}: no config.json in {path}")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(
            f"{name}: no weights in {path} (model.safetensors or pytorch_model.bin, or their "
            "sharded index)"
        )
    return path


def _download(name: str, revision: str | None) -> Path:
    """The hub repository `name` in the hub's cache, downloaded unless it is there."""
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError(
            f"{name} is no local folder, and huggingface_hub is not installed to download it "
            "(pip install 'mecheval[pretrained]')"
        ) from None
    try:
        path = Path(
            huggingface_hub.snapshot_download(name, revision=revision, allow_patterns=HUB_FILES)
        )
        if not any((path / f).is_file() for f in WEIGHT_FILES):  # a repository without safetensors
            path = Path(
                huggingface_hub.snapshot_download(name, revision=revision, allow_patterns=["*.bin"])
            )
    except Exception as error:  # noqa: BLE001  (offline, unreachable, unknown, gated: one line)
        text = str(error).strip()
        reason = text.splitlines()[0].split(". ")[0] if text else ""  # its first sentence
        raise ValueError(
            f"{name} is no local folder, and the Hugging Face hub did not give it "
            f"({type(error).__name__}: {reason[:160]}); put config.json and the weights "
            "(*.safetensors) in a folder and pass its path"
        ) from None
    return path


def _config(folder: Path, name: str):
    """The transformers config of the checkpoint in `folder` (fla's families through fla's
    config classes, which importing fla.models registers)."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as error:
        raise ValueError(f"{name}: config.json is not readable JSON ({error})") from None
    if model_type in FLA_TYPES:
        try:
            import fla.models  # noqa: F401  (registers fla's configs and models with transformers)
        except ImportError:
            raise ValueError(
                f"{name} is a flash-linear-attention {model_type} checkpoint: install "
                "flash-linear-attention to read it"
            ) from None
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{name}: transformers cannot read its config ({first[:200]})") from None


def _hf_model(folder: Path, config, name: str, dtype: torch.dtype):
    """The transformers model object of the checkpoint, every weight read from it (a weight the
    checkpoint lacks is refused by name, not left at random)."""
    import transformers

    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=dtype, output_loading_info=True
    )
    missing = [k for k in info.get("missing_keys", ()) if not k.startswith("lm_head.")]
    if missing or (info.get("missing_keys") and not _tied(config)):
        shown = ", ".join(sorted(info["missing_keys"])[:4])
        raise ValueError(f"{name}: the checkpoint lacks weights ({shown})")
    return hf_model.eval()


def _tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))
