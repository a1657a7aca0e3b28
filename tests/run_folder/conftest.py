import pytest


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Each test's task datasets in its own cache, never the user's."""
    monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "cache"))
