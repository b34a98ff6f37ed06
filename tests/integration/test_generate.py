"""`shardtune generate` and `shardtune chat` on a briefly trained demo run: the held-out strings it reverses are
exactly those the run's own demo check counted (same prompts, same greedy decode), and chat answers piped lines."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shardtune.config.load import load_recipe
from shardtune.data import build_data
from shardtune.model.build import build_tokenizer
from tests.integration import forked
from tests.integration.runs import SHARDTUNE, cli, forked_cli, summary

SAMPLES = 24


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """~100 steps of the demo: enough that it reverses part of the held-out strings, not all. On one forked rank
    with the recipe's global batch (forked.py: the launcher's checks and the worker without the CLI's start-up):
    generate and chat are tested."""
    run = tmp_path_factory.mktemp("gen") / "run"
    result = forked.train_on_one_rank("tiny-cpu", f"train.output_dir={run}", "train.max_steps=100",
                                      "train.eval_every=0", f"train.demo_eval_samples={SAMPLES}", "data.seq_len=64",
                                      "data.num_samples=2000")
    assert result.code == 0, result.err[-3000:]
    return run


def held_out(run: Path) -> list[dict]:
    recipe = load_recipe(run / "recipe.yaml")
    data = build_data(recipe.data, build_tokenizer(recipe.model), seed=recipe.train.seed,
                      output_dir=recipe.train.output_dir)  # a cache hit: the run's own split
    return list(data.eval_raw[:SAMPLES])


@pytest.fixture(scope="module")
def answers(run_dir) -> list[str]:
    """`generate` on final/ with every held-out prompt, greedy (one process)."""
    prompts = [arg for r in held_out(run_dir) for arg in ("--prompt", r["prompt"])]
    proc = forked_cli("generate", str(run_dir / "final"), *prompts, "--max-new-tokens", "8", cwd=run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_generate_reverses_held_out_strings_as_the_run_measured(run_dir, answers):
    rows = held_out(run_dir)
    assert len(answers) == len(rows)
    correct = sum(a == r["response"] for a, r in zip(answers, rows))
    assert correct > 0 and correct / len(rows) == summary(run_dir)["accuracy_after"], (answers, rows)
    reversed_ = next(r for a, r in zip(answers, rows) if a == r["response"])
    assert reversed_["response"] == reversed_["prompt"].removeprefix("reverse ").removesuffix("=")[::-1]
    # Sampling is seeded per prompt: the same prompt twice gives the same sample.
    proc = forked_cli("generate", str(run_dir / "final"), "--prompt", rows[0]["prompt"], "--prompt", rows[0]["prompt"],
               "--temperature", "1.5", "--top-p", "0.9", "--seed", "3", cwd=run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, again = proc.stdout.splitlines()
    assert first == again


def test_chat_answers_each_piped_line(run_dir, answers):
    rows = held_out(run_dir)[:3]
    stdin = "".join(r["prompt"] + "\n" for r in rows) + "/exit\nnot read\n"
    proc = subprocess.run([SHARDTUNE, "chat", str(run_dir), "--max-new-tokens", "8"], input=stdin,
                          capture_output=True, text=True, timeout=300, cwd=run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == answers[:3]  # one reply per line, the same greedy answers as generate


def test_generate_on_a_missing_or_foreign_folder_is_one_line(tmp_path):
    proc = cli("generate", str(tmp_path), "--prompt", "x", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "run directory" in proc.stderr, proc.stderr


def test_generate_asks_a_foreign_folder_through_its_chat_template(tmp_path):
    """A model folder with no run around it (downloaded, or exported elsewhere) and its own chat template: the prompt
    and --system go through that template, and the reply stops at its end of turn; the same greedy tokens as
    transformers' generate on the rendered chat, and not those of the raw prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardtune.templates import CHAT_TEMPLATES
    from tests.integration.test_model_folder import write_checkpoint

    folder = tmp_path / "chat-model"
    tok = write_checkpoint(folder)
    tok.chat_template = CHAT_TEMPLATES["chatml"]
    tok.save_pretrained(folder)
    proc = forked_cli("generate", str(folder), "--prompt", "reverse hello=", "--system", "answer briefly",
               "--max-new-tokens", "12", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()

    def greedy(text: str) -> str:
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, stop_strings=["<|im_end|>"], tokenizer=tok)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("<|im_end|>", 1)[0]

    chat = tok.apply_chat_template([{"role": "system", "content": "answer briefly"},
                                    {"role": "user", "content": "reverse hello="}], tokenize=False,
                                   add_generation_prompt=True)
    # text-mode pipes read any \r as \n (universal newlines), and an untrained model may well reply with one
    assert proc.stdout.rstrip("\n") == greedy(chat).replace("\r\n", "\n").replace("\r", "\n")
    assert greedy(chat) != greedy(tok.bos_token + "reverse hello=")  # the template changes the answer


def test_base_given_for_a_full_model_is_ignored_with_a_warning(tmp_path):
    from tests.integration.test_model_folder import write_checkpoint

    folder = tmp_path / "model"
    write_checkpoint(folder)
    proc = forked_cli("generate", str(folder), "--prompt", "reverse abc=", "--max-new-tokens", "2", "--base",
                      str(folder), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"warning: --base is ignored: '{folder}' is a full model, not a LoRA adapter" in proc.stderr.splitlines()
