"""The code of an architecture (mecheval.models.provenance): its hash follows the source of the
factory and of the mixer classes it builds, and nothing else (not where the file lies)."""

from __future__ import annotations

import shutil
import sys
import uuid

import pytest

from mecheval.models import model_config, register_mixer
from mecheval.models.provenance import architecture_code
from mecheval.models.registry import unregister_mixer

SOURCE = """
from torch import nn

from mecheval.layers import Mixer


class Mix(Mixer):
    def __init__(self, d_model):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.proj(x).cumsum(1)
"""


@pytest.fixture
def module(tmp_path, monkeypatch):
    name = f"provenance_mix_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(folder))
    yield name, folder / f"{name}.py"
    sys.modules.pop(name, None)


def _code(arch: str, **options) -> dict:
    return architecture_code(model_config(arch, 20, 8, 2, max_len=6, **options))


def test_an_import_path_hashes_its_modules_file(module, tmp_path):
    name, path = module
    first = _code(f"{name}:Mix")[f"{name}:Mix"]
    assert first["factory"] == f"{name}.Mix" and first["sources"] == [str(path.resolve())]
    path.write_text(SOURCE + "\n# a comment is a change of the file\n")
    assert _code(f"{name}:Mix")[f"{name}:Mix"]["sha256"] != first["sha256"]
    path.write_text(SOURCE)
    moved = tmp_path / "b"
    moved.mkdir()
    shutil.copy(path, moved / path.name)
    sys.modules.pop(name)
    with pytest.MonkeyPatch.context() as patch:  # the same module, found in another folder
        patch.setattr(sys, "path", [str(moved), *sys.path[1:]])
        again = _code(f"{name}:Mix")[f"{name}:Mix"]
    assert again["sources"] == [str((moved / path.name).resolve())]
    assert again["sha256"] == first["sha256"]


def test_a_registered_name_hashes_the_source_of_its_factory_and_classes(module):
    name, path = module
    mix = __import__(name).Mix
    register_mixer("provenance_mix", mix)
    try:
        code = _code("provenance_mix")["provenance_mix"]
        assert code["sources"] == [f"{name}.Mix"]
        path.write_text(SOURCE.replace("cumsum(1)", "cumsum(1) * 2"))
        assert _code("provenance_mix")["provenance_mix"]["sha256"] != code["sha256"]
    finally:
        unregister_mixer("provenance_mix")


def test_the_zoos_code_is_its_factory_and_the_mixer_classes_it_builds():
    code = _code("based")["based"]  # BaseConv in even layers, Based attention in odd ones
    assert code["factory"] == "mecheval.models.zoo.based"
    assert code["sources"] == [
        "mecheval.models.zoo.based",
        "mecheval.layers.base_conv.BaseConv",
        "mecheval.layers.based.BasedLinearAttention",
    ]
    assert _code("based")["based"]["sha256"] == code["sha256"]
    hybrid = _code("mamba+deltanet")
    assert set(hybrid) == {"mamba", "deltanet"}
    assert "mecheval.layers.recurrent.RecurrentMixer" in hybrid["deltanet"]["sources"]
