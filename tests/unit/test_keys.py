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


def test_a_prefix_of_a_key_name_lists_the_keys_it_starts(capsys):
    """Issue 59: `keys launch.threads` said no key starts with it, although launch.threads_per_worker exists."""
    code, out, err = run_cli(["keys", "launch.threads"], capsys)
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()] == ["launch.threads_per_worker"]
    assert [line.split()[0] for line in format_keys("train.eval_").splitlines()] == [
        k for k in recipe_keys() if k.startswith("train.eval_")]


def test_no_key_meaning_is_cut_mid_sentence():
    """Issue 59: launch.threads_per_worker's meaning stopped at its comment's first line ("... else"). A meaning is
    its whole comment, continuation lines included, or that comment's first full sentence; and every comment line
    of a schema section's fields belongs to some field's comment."""
    import inspect
    import re
    from dataclasses import fields, is_dataclass

    from shardtune.config.keys import _comments

    def sections(cls, prefix=""):
        yield cls, prefix
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default
            if is_dataclass(default):
                yield from sections(type(default), f"{prefix}{f.name}.")

    meaning = {k.key: k.meaning for k in schema_keys()}
    threads = meaning["launch.threads_per_worker"]
    assert threads.endswith("cores / workers on CPU and under engine.cpu_offload; else torchrun's 1)"), threads
    checked = 0
    for cls, prefix in sections(Recipe):
        notes = _comments(cls)
        for name, full in notes.items():
            shown = meaning.get(prefix + name)
            if shown is None:  # a section's own comment
                continue
            checked += 1
            assert shown == full or (full.startswith(shown + " ") and shown.endswith(".")), (name, shown)
            assert shown.count("(") == shown.count(")") and shown.count("[") == shown.count("]"), (name, shown)
        body = inspect.getsource(cls).split("\n    def ", 1)[0]  # the fields, before the first method
        said = " ".join(notes.values())
        for line in body.splitlines():
            m = re.match(r"\s{4}#(.*)", line)
            if m and m.group(1).strip():
                assert m.group(1).strip() in said, (cls.__name__, line)
    assert checked == len(meaning)
