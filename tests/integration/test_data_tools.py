"""Issue 59's data tools and small fixes through the installed executable: `keys PREFIX` by the start of a name,
the one-line fixes for a list or a section given one value, `validate --print` (the resolved recipe as YAML that
loads back) with the token-length warning, and `prepare --show N` on the same prompt as SFT and as DPO pairs with
data.template=alpaca. In-process halves: tests/unit/test_keys.py, test_config_errors.py, test_data_lengths.py,
test_data_show.py, test_preference_data.py. Two commands at a time: each is a single-threaded start-up."""
from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.integration.runs import SHARDTUNE
from tests.unit.test_data_formats import TOOL_TEMPLATE
from tests.unit.test_data_lengths import _tool_rows


def _commands(tmp: Path) -> dict[str, list[str]]:
    tools = tmp / "tools.jsonl"
    tools.write_text("".join(json.dumps(r) + "\n" for r in _tool_rows(20)))
    pairs, sft = tmp / "pairs.jsonl", tmp / "sft.jsonl"
    pairs.write_text(json.dumps({"prompt": "sky?", "chosen": "blue", "rejected": "green"}) + "\n")
    sft.write_text(json.dumps({"prompt": "sky?", "response": "blue"}) + "\n")
    common = ["data.template=alpaca", "data.eval_fraction=0", "data.seq_len=256", "--show", "0"]
    return {
        "keys": ["keys", "launch.threads"],
        "list": ["validate", "tiny-cpu", "lora.target_modules=q_proj,v_proj"],
        "section": ["validate", "tiny-cpu", "lora=true"],
        "print": ["validate", "tiny-cpu", f"data.path={tools}", "data.format=chat", "data.seq_len=256",
                  f"model.chat_template={TOOL_TEMPLATE}", "train.lr=1e-4", "--print"],
        "sft": ["prepare", "tiny-cpu", f"data.path={sft}", "data.format=instruction", f"train.output_dir={tmp / 's'}",
                *common],
        "dpo": ["prepare", "tiny-dpo-cpu", f"data.path={pairs}", f"train.output_dir={tmp / 'd'}", *common],
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("data_tools")

    def run(item):
        name, argv = item
        return name, subprocess.run([SHARDTUNE, *argv], capture_output=True, text=True, timeout=300, cwd=tmp)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, _commands(tmp).items()))


def test_keys_finds_a_key_by_the_start_of_its_name_with_its_whole_meaning(results):
    r = results["keys"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:4] == ["launch.threads_per_worker", "int", "|", "None"]
    assert r.stdout.rstrip().endswith("else cores / workers on CPU and under engine.cpu_offload; else torchrun's 1)")


@pytest.mark.parametrize("name,fix", [("list", "write lora.target_modules=[q_proj,v_proj]"),
                                      ("section", "write lora.enabled=true")])
def test_a_list_or_section_given_one_value_is_one_line_with_the_fix(results, name, fix):
    r = results[name]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and fix in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_validate_prints_the_resolved_recipe_and_warns_of_cut_rows(results, tmp_path):
    r = results["print"]
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)  # stdout is the YAML alone: the ok line and warnings are on stderr
    assert printed["train"]["lr"] == 1e-4 and printed["data"]["format"] == "chat"
    assert printed["train"]["betas"] == [0.9, 0.999] and printed["data"]["seq_len"] == 256  # defaults too
    assert set(printed) >= {"model", "lora", "engine", "data", "train", "launch", "hardware"}
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("ok: tiny-cpu ("), err
    warning = [ln for ln in err if ln.startswith("warning: data.path")]
    assert len(warning) == 1 and "10 of the first 20 rows are longer than data.seq_len=256 tokens" in warning[0]
    assert "10 of them have trained tokens past it" in warning[0] and "raise data.seq_len" in warning[0]
    # the printed recipe is a recipe: it loads back to itself
    from shardtune.config.load import load_recipe_config, to_yaml

    (tmp_path / "resolved.yaml").write_text(r.stdout)
    assert to_yaml(load_recipe_config(tmp_path / "resolved.yaml")) == r.stdout


def test_prepare_shows_a_dpo_pair_prompted_as_sft_with_the_template(results):
    sft, dpo = results["sft"], results["dpo"]
    assert sft.returncode == 0 and dpo.returncode == 0, sft.stderr + dpo.stderr
    alpaca = ("«<s>Below is an instruction that describes a task. Write a response that appropriately completes "
              "the request.\n\n### Instruction:\nsky?\n\n### Response:\n»")
    assert alpaca + "blue</s>\nspans (token positions): masked 0-" in sft.stdout, sft.stdout[-800:]
    shown = dpo.stdout[dpo.stdout.index("example 0: pair 0"):]
    assert shown.count(alpaca) == 2 and alpaca + "blue</s>" in shown and alpaca + "green</s>" in shown, shown
    sft_line = next(ln for ln in sft.stdout.splitlines() if ln.startswith("document: "))
    chosen_line = next(ln for ln in shown.splitlines() if ln.startswith("chosen: "))
    assert sft_line.removeprefix("document: ") == chosen_line.removeprefix("chosen: ")  # the same tokens and counts
    assert "template alpaca for string prompts" in dpo.stdout
