"""Which `model.path` values are Hub ids: OWNER/NAME[@REVISION] that is not an existing path (a local folder of
that name wins, resolved as any path is)."""
from __future__ import annotations

from shardtune.config.load import load_recipe
from shardtune.hub import is_hub_id, split_id
from tests.integration.test_model_folder import write_checkpoint


def test_a_local_folder_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("acme/tiny") and is_hub_id("acme/tiny@v1.0") and is_hub_id("acme/tiny@refs/pr/1")
    assert not any(is_hub_id(v) for v in ("tiny", "./acme/tiny", "/abs/acme/tiny", "acme/tiny/extra", "a b/c"))
    assert split_id("acme/tiny@0123abc") == ("acme/tiny", "0123abc") and split_id("acme/tiny") == ("acme/tiny", None)
    write_checkpoint(tmp_path / "acme" / "tiny")
    assert not is_hub_id("acme/tiny")
    recipe = load_recipe("tiny-cpu", ["model.path=acme/tiny", "model.init=pretrained"])
    assert recipe.model.path == str(tmp_path / "acme" / "tiny")  # the folder, made absolute; no Hub asked
