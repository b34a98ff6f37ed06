"""Bad input never gives a traceback: each case exits 2 with one line naming the key/file and a fix."""
from __future__ import annotations

import json

import pytest

from shardtune.bundled import CONFIGS_DIR
from tests.unit.cli_helpers import run_cli

BAD_OVERRIDES = [
    (["train.lrr=1e-4"], "train.lrr"),  # unknown key (with a suggestion)
    (["foo.bar=1"], "foo"),  # unknown section
    (["train.max_steps=abc"], "train.max_steps"),  # wrong type
    (["train.micro_batch_size=0"], "train.micro_batch_size"),  # out of range
    (["train.grad_accum=-1"], "train.grad_accum"),
    (["train.lr=-1"], "train.lr"),
    (["engine.strategy=zero3"], "engine.strategy"),  # not a choice
    (["engine.mixed_precision=fp16"], "engine.mixed_precision"),
    (["engine.activation_checkpointing=0"], "engine.activation_checkpointing"),
    (["lora.dropout=1.5"], "lora.dropout"),
    (["data.seq_len=2"], "data.seq_len"),
    (["data.format=csv"], "data.format"),
    (["model.config=/nonexistent/config.json"], "model.config"),  # missing file
    (["data.path=/nonexistent/data.jsonl"], "data.path"),
    (["data.path=builtin:nosuch"], "data.path"),  # unknown builtin
    (["train.lr"], "train.lr"),  # not KEY=VALUE
    (["launch.nproc_per_node=0"], "launch.nproc_per_node"),
    (["engine.strategy=hybrid_shard", "engine.hybrid_shard_size=3"], "engine.hybrid_shard_size"),  # impossible
    (["launch.device=cuda"], "launch.device"),  # no GPU on the test machine
    (["model.init=pretrained"], "model.path"),  # conflicting options
    (["train.schedule=exp"], "train.schedule"),
    (["train.resume=/nonexistent/step_5"], "train.resume"),  # not a complete checkpoint
    (["lora.quantize_base=nf4"], "lora.quantize_base"),  # QLoRA without LoRA
    (["lora.enabled=true", "lora.quantize_base=int3"], "lora.quantize_base"),  # not a choice
    (["train.objective=dpo"], "train.objective"),  # dpo needs data.format=preference
    (["data.format=preference"], "data.format"),  # preference rows need train.objective=dpo
    (["train.objective=ppo"], "train.objective"),
    (["train.objective=dpo", "data.format=preference", "dpo.loss=kto"], "dpo.loss"),
    (["train.objective=dpo", "data.format=preference", "dpo.loss=ipo", "dpo.label_smoothing=0.1"],
     "dpo.label_smoothing"),  # smoothing has a meaning for sigmoid only
    (["train.objective=dpo", "data.format=preference", "dpo.precompute_reference=false"],
     "dpo.precompute_reference"),  # full fine-tuning has no adapters to switch off
    (["train.objective=dpo", "data.format=preference", "train.demo_eval=true"], "train.demo_eval"),
    (["data.prompt_field=[instruction,input]"], "data.input_field"),  # Alpaca's two columns as one list
    (["engine.wrap=[NoSuchLayer]"], None),  # checked when the model is built; validate accepts class names
    # inf and NaN, as YAML and the command line spell them: range checks let inf through (lr > 0), to fail later
    # as an overflow (int(inf * MiB) in the tile size) or a NaN loss
    (["engine.nf4_tile_mb=INFINITY"], "engine.nf4_tile_mb"),
    (["train.lr=inf"], "train.lr"),
    (["train.eps=nan"], "train.eps"),
    (["train.max_grad_norm=.inf"], "train.max_grad_norm"),
    (["hardware.host_ram_gb=-inf"], "hardware.host_ram_gb"),
    (["train.seed=-1"], "train.seed"),  # numpy's generators (the data split) take no negative seed
    (["train.eps=-1e-8"], "train.eps"),  # AdamW refuses it in every worker
    (["data.path=[{path: builtin:reverse, weight: inf}]"], "data.path[0].weight"),  # a mix entry (its own check)
    # context parallelism: a row that does not split evenly, and what the split attention does not run with
    (["engine.context_parallel=true", "data.seq_len=127"], "engine.context_parallel"),
    (["engine.context_parallel=true", "engine.backend=torch"], "engine.context_parallel"),
    (["engine.context_parallel=true", "model.attn_implementation=eager"], "engine.context_parallel"),
]


@pytest.mark.parametrize("overrides,key", [c for c in BAD_OVERRIDES if c[1]], ids=lambda v: str(v))
def test_bad_override_is_one_line_exit_2(overrides, key, capsys):
    if key == "launch.device":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    code, out, err = run_cli(["validate", "tiny-cpu", *overrides], capsys)
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert key in lines[0], lines[0]
    assert "Traceback" not in err


BAD_FILES = {
    "missing": None,
    "invalid_yaml": "model: [unclosed\n",
    "not_mapping": "- a\n- b\n",
    "unknown_key_in_file": "train:\n  max_stepz: 3\n",
    "wrong_type_in_file": "train:\n  max_steps: ten\n",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_recipe_file(name, tmp_path, capsys):
    path = tmp_path / f"{name}.yaml"
    if BAD_FILES[name] is not None:
        path.write_text(BAD_FILES[name])
    code, _, err = run_cli(["validate", str(path)], capsys)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert path.name in lines[0] or "train.max_step" in lines[0], lines[0]


def test_unknown_key_suggests_the_right_one(capsys):
    _, _, err = run_cli(["validate", "tiny-cpu", "train.lrr=1e-4"], capsys)
    assert "did you mean 'train.lr'" in err


# The installed console script's one line for a bad value: tests/integration/test_installed_executable.py.


def test_good_recipe_validates(capsys):
    code, out, err = run_cli(["validate", "tiny-cpu", "train.lr=1e-4"], capsys)
    assert code == 0, err
    assert out.startswith("ok: tiny-cpu")


def _config_with_vocab(tmp_path, rows: int) -> str:
    import json

    from shardtune.bundled import DATA_DIR

    config = json.loads((DATA_DIR / "configs" / "models" / "tiny-llama.json").read_text())
    path = tmp_path / f"vocab{rows}.json"
    path.write_text(json.dumps({**config, "vocab_size": rows}))
    return str(path)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(tmp_path, capsys):
    """builtin:char has 100 ids: a 64-row model would train on zero embeddings for the rest, without an error (the
    trainer refuses too: tests/integration/test_cli_train.py)."""
    code, _, err = run_cli(["validate", "tiny-cpu", f"model.config={_config_with_vocab(tmp_path, 64)}"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: model.tokenizer: the tokenizer has 100 tokens but the model's vocab_size is 64")
    code, _, err = run_cli(["validate", "tiny-cpu", f"model.config={_config_with_vocab(tmp_path, 100)}"], capsys)
    assert code == 0, err  # every id has its row


@pytest.mark.parametrize("key", ["data.path", "model.path"])
def test_a_url_is_one_line_that_says_to_download_it(capsys, key):
    url = "https://example.com/files/data.jsonl"
    code, _, err = run_cli(["validate", "tiny-cpu", f"{key}={url}"], capsys)
    assert code == 2 and err.strip() == (f"error: {key}: '{url}' is a URL: shardtune reads local paths and Hugging "
                                         "Face repo ids (OWNER/NAME); download the file and give its path"), err


@pytest.mark.parametrize("part", ["config", "tokenizer"])
def test_a_model_that_needs_its_own_code_is_one_line_without_a_prompt(tmp_path, capsys, part):
    """A repo whose config or tokenizer names its own Python classes (auto_map): transformers asked "Do you wish to
    run the custom code? [y/N]" on a terminal, then failed with a cut message advising another path."""
    folder = tmp_path / "custom"
    folder.mkdir()
    config = json.loads((CONFIGS_DIR / "models" / "tiny-llama.json").read_text())
    if part == "config":
        config.update(model_type="mylm", auto_map={"AutoConfig": "configuration_mylm.MyConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    key = "model.path"
    if part == "tokenizer":
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"auto_map": {"AutoTokenizer": ["tokenization_mylm.MyTokenizer", None]}, "tokenizer_class": "MyTokenizer"}))
        key = "model.tokenizer"
    code, _, err = run_cli(["validate", "tiny-cpu", f"model.path={folder}"], capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}: '{folder}' needs its own Python "
                                                                    "code"), err
    assert "[y/N]" not in err


@pytest.mark.parametrize("command,key", [("validate", "train.output_dir"), ("train", "train.output_dir"),
                                         ("prepare", "data.cache_dir")])
def test_a_run_folder_that_cannot_be_made_is_one_line(tmp_path, capsys, command, key):
    """A file where the run's folder must go: train and prepare printed mkdir's NotADirectoryError traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run_cli([command, "tiny-cpu", f"{key}={blocker / 'run'}"], capsys)
    assert code == 2 and err.strip() == (f"error: {key}: '{blocker / 'run'}' cannot be a folder: '{blocker}' is a "
                                         f"file; choose another {key}"), err


def test_a_path_the_file_system_refuses_is_one_line(capsys):
    """What the checks cannot foresee (here /proc, which refuses new folders even to root): the OS's reason and the
    path, exit 2, no traceback."""
    code, _, err = run_cli(["train", "tiny-cpu", "train.output_dir=/proc/shardtune-run"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'/proc/shardtune-run'" in err, err


def test_context_parallel_refuses_dpo_and_sliding_windows_in_one_line(tmp_path, capsys):
    """engine.context_parallel with DPO (log-probabilities summed over a whole row), and on a model whose layers
    attend through a sliding window (the split attention is causal over the whole row)."""
    config = json.loads((CONFIGS_DIR / "models" / "tiny-qwen2.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    (tmp_path / "windowed.json").write_text(json.dumps(config))
    for args in (["tiny-dpo-cpu"], ["tiny-cpu", f"model.config={tmp_path / 'windowed.json'}"]):
        code, out, err = run_cli(["validate", *args, "engine.context_parallel=true"], capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "engine.context_parallel" in lines[0], (args, out, err)


@pytest.mark.parametrize("override,line", [
    ("lora.target_modules=q_proj,v_proj", "error: override: key 'lora.target_modules' takes a list, got 'q_proj,v_proj': "
     "write lora.target_modules=[q_proj,v_proj] (a YAML list, in brackets)"),
    ("lora=true", "error: override lora=true: 'lora' is a section of keys, not a value: write lora.enabled=true "
     "(`shardtune keys lora` lists its keys)"),
    ("train=3", "error: override train=3: 'train' is a section of keys, not a value: write train.KEY=VALUE "
     "(`shardtune keys train` lists its keys)"),
])
def test_a_list_or_section_given_one_value_names_the_fix(override, line, capsys):
    """Issue 59: these surfaced OmegaConf's own messages ("AnyNode is not a ListConfig", "Merge error: bool is not a
    subclass of LoraConfig") without the key or the fix. The executable's: tests/integration/test_data_tools.py."""
    code, _, err = run_cli(["validate", "tiny-cpu", override], capsys)
    assert code == 2 and err.strip() == line, err


@pytest.mark.parametrize("override,line", [
    ("dpo.beta=abc", "error: override: key 'dpo.beta' takes a number, got 'abc': write e.g. dpo.beta=0.1 (its default)"),
    ("train.grad_accum=[1,2]", "error: override: key 'train.grad_accum' takes a whole number, got '[1, 2]': write "
     "e.g. train.grad_accum=1 (its default)"),
    ("train.max_steps=ten", "error: override: key 'train.max_steps' takes a whole number, got 'ten': "
     "`shardtune keys train.max_steps` says what it means"),  # no example where the default is null
    ("data.seq_len=1e3", "error: override: key 'data.seq_len' takes a whole number, got '1e3': write e.g. "
     "data.seq_len=512 (its default)"),
    ("engine.cpu_offload=maybe", "error: override: key 'engine.cpu_offload' takes true or false, got 'maybe': write "
     "e.g. engine.cpu_offload=false (its default)"),
])
def test_a_value_of_the_wrong_type_names_the_type_and_an_example(override, line, capsys):
    """Issue 59's probe: OmegaConf's "Value 'abc' of type 'str' could not be converted to Float" named the key but no
    fix. The line says what the key takes and shows its default as a value that parses."""
    code, _, err = run_cli(["validate", "tiny-cpu", override], capsys)
    assert code == 2 and err.strip() == line, err


def test_the_same_in_a_recipe_file(tmp_path, capsys):
    section = tmp_path / "section.yaml"
    section.write_text("lora: true\n")
    listed = tmp_path / "listed.yaml"
    listed.write_text("lora:\n  enabled: true\n  target_modules: q_proj,v_proj\n")
    code, _, err = run_cli(["validate", str(section)], capsys)
    assert code == 2 and err.strip() == (f"error: {section}: 'lora' is a section of keys, not a value: write "
                                         "lora: {enabled: true} (`shardtune keys lora` lists its keys)"), err
    code, _, err = run_cli(["validate", str(listed)], capsys)
    assert code == 2 and err.strip() == (f"error: {listed}: key 'lora.target_modules' takes a list, got "
                                         "'q_proj,v_proj': write target_modules: [q_proj, v_proj] (a YAML list, in "
                                         "brackets)"), err
