import pytest

from spear.errors import SpearError
from spear.models import loading


def test_missing_and_invalid_model_paths(tmp_path):
    with pytest.raises(SpearError, match="neither 'smollm2-135m' nor an existing local folder"):
        loading.resolve_model_path(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpearError, match="has no config.json"):
        loading.resolve_model_path(tmp_path / "empty")


def test_interrupted_default_conversion_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        loading.resolve_model_path("smollm2-135m")
    models = tmp_path / "models"
    assert not models.exists() or not any(models.iterdir())


def test_half_written_default_folder_is_not_trusted(tmp_path, monkeypatch, default_model_path):
    monkeypatch.setenv("SPEAR_CACHE", str(tmp_path))
    half = tmp_path / "models" / "smollm2-135m"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # no completion marker
    converted = []
    monkeypatch.setattr(loading, "_convert_default", lambda target: converted.append(target))
    loading.resolve_model_path("smollm2-135m")
    assert converted == [half] and not half.exists()


def test_tiny_hf_folder_loads(tiny_llama_path):
    model, tok = loading.load_model(tiny_llama_path)
    assert model.config.num_hidden_layers == 2 and tok.bos_token_id is not None
