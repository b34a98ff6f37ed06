"""`shardtune keys`: generated from the schema, so it lists exactly the schema's keys, each with a meaning."""
from __future__ import annotations

from shardtune.config.keys import format_keys, schema_keys
from shardtune.config.load import recipe_keys
from shardtune.config.schema import Recipe
from tests.unit.cli_helpers import run_cli


def test_keys_lists_every_schema_key_with_type_default_and_meaning(capsys):
    code, out, _ = run_cli(["keys"], capsys)
    assert code == 0
    listed = [line.split()[0] for line in out.splitlines()]
    sections = {k for k in recipe_keys() if "." not in k and k != "description"}
    assert listed == [k for k in recipe_keys() if k not in sections]  # every leaf key, in schema order, once
    undocumented = [k.key for k in schema_keys() if not k.meaning]
    assert not undocumented, f"schema fields without a comment (the meaning `shardtune keys` shows): {undocumented}"
    defaults = Recipe()
    for info in schema_keys():
        section, _, name = info.key.rpartition(".")
        value = getattr(getattr(defaults, section) if section else defaults, name)
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else None
        if shown is not None:
            assert info.default == shown, info


def test_keys_prefix_filters_and_an_unknown_one_is_one_line(capsys):
    code, out, _ = run_cli(["keys", "lora"], capsys)
    assert code == 0 and {line.split()[0] for line in out.splitlines()} == {
        k for k in recipe_keys() if k.startswith("lora.")}
    line = next(ln for ln in format_keys("train.lr").splitlines())
    assert line.split()[:3] == ["train.lr", "float", "0.0002"]
    code, _, err = run_cli(["keys", "trian"], capsys)
    assert code == 2 and err.count("\n") == 1 and "trian" in err


def test_unknown_key_points_to_keys(capsys):
    code, _, err = run_cli(["validate", "tiny-cpu", "train.zzz=1"], capsys)
    assert code == 2 and "shardtune keys" in err
