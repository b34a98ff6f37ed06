"""`shardtune generate` and `shardtune chat`: try a trained model in one process, on CPU or one GPU.

What can be given: a run directory (its final/, else its newest checkpoint), a final/ or exported folder (a full HF
model or a PEFT adapter), or a sharded checkpoint (consolidated into a temporary folder first). The run's
recipe.yaml, found beside or above it, says how prompts were rendered in training (data.format, data.template,
model.chat_template) and, for an adapter, which base it was trained over. A folder away from its run says it
with the record `shardtune export` writes, else with its own chat template (model/prompt_style.py); an adapter
away from its run loads on the base its adapter_config.json names (a local folder), or on --base.
"""
from __future__ import annotations

import json
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardtune.checkpoint.paths import TRAINER_FILE
from shardtune.config.schema import Recipe
from shardtune.errors import UserError
from shardtune.model.prompt_style import PromptStyle, folder_style, style_of_recipe

if TYPE_CHECKING:  # torch and transformers load only once the target is known to be a model (a typo costs ~0 s)
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    warned: bool = False  # the clamped budget's warning (new_tokens) is printed once a session


@dataclass
class Loaded:
    model: PreTrainedModel
    tok: PreTrainedTokenizerBase
    recipe: Recipe | None
    folder: PromptStyle | None = None  # the folder's own style, used when no recipe is found

    @cached_property  # once: a DPO run's style reads the head of its data file
    def style(self) -> PromptStyle:
        if self.recipe is not None:
            return style_of_recipe(self.recipe)
        return self.folder or PromptStyle("chat" if self.tok.chat_template else "text")


def find_recipe(target: Path) -> Recipe | None:
    """recipe.yaml in the target or up to two folders above it (final/ -> run, step_N -> checkpoints -> run)."""
    from shardtune.config.load import load_recipe

    for d in (target, target.parent, target.parent.parent):
        if (d / "recipe.yaml").is_file():
            return load_recipe(d / "recipe.yaml")
    return None


def check_target(target: Path) -> None:
    """A one-line error for a target that holds no model, before anything heavy is imported."""
    if not target.exists():
        raise UserError(f"generate: '{target}' does not exist: give a run directory, its final/ or a checkpoint")
    if (target / "recipe.yaml").is_file() or (target / "latest").is_file():
        return
    if not any((target / f).is_file() for f in ("config.json", "adapter_config.json", TRAINER_FILE)):
        raise UserError(f"generate: '{target}' is neither a run directory, a model folder (config.json) nor a "
                        "checkpoint (trainer.json): point it at one of those")


@contextmanager
def model_folder(target: Path) -> Iterator[Path]:
    """The HF folder (full model or adapter) behind `target`; a checkpoint is consolidated into a temp folder."""
    if (target / "recipe.yaml").is_file():  # a run directory
        if (target / "final").is_dir():
            yield target / "final"
            return
        target = target / "checkpoints"
    if (target / "latest").is_file():
        target = target / (target / "latest").read_text().strip()
    if (target / TRAINER_FILE).is_file():
        from shardtune.checkpoint.consolidate import export_checkpoint

        with tempfile.TemporaryDirectory(prefix="shardtune-generate-") as tmp:
            export_checkpoint(target, Path(tmp))
            yield Path(tmp)
        return
    check_target(target)  # a run directory's checkpoints/ may hold no checkpoint yet
    yield target


def load(target: Path, device: str, base: Path | None = None) -> Loaded:
    """`base`: --base, the model folder a LoRA adapter was trained over (ignored, with a warning, for a full model)."""
    check_target(target)
    if base is not None:
        check_base(base)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars: noise before a one-line answer
    recipe = find_recipe(target)
    with model_folder(target) as folder:
        if (folder / "adapter_config.json").is_file():
            from peft import PeftModel

            base_model, base_dir = _base(folder, recipe, base)
            tok = AutoTokenizer.from_pretrained(folder if _has_tokenizer(folder) or base_dir is None else base_dir,
                                                local_files_only=True)
            with warnings.catch_warnings():  # peft reads a property transformers 5 deprecates (as in model/lora.py)
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                model = PeftModel.from_pretrained(base_model, str(folder)).merge_and_unload()
        else:
            if base is not None:
                warnings.warn(f"--base is ignored: '{target}' is a full model, not a LoRA adapter", stacklevel=2)
            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        style = folder_style(folder, bool(tok.chat_template))
    if recipe is not None:
        from shardtune.templates import resolve_chat_template

        tok.chat_template = resolve_chat_template(tok.chat_template, recipe.model.chat_template)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return Loaded(model.to(_device(device)).eval(), tok, recipe, style)


def check_base(base: Path) -> None:
    if not (base / "config.json").is_file():
        raise UserError(f"--base {base}: not a model folder (no config.json): give the folder of the model the "
                        "adapter was trained over (config.json and its weights)")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _base(folder: Path, recipe: Recipe | None, base: Path | None) -> tuple[PreTrainedModel, Path | None]:
    """The model an adapter was trained over, and its folder (None for a rebuilt random init): --base, else the run's
    recipe (its checkpoint, or its seeded random init), else the local folder adapter_config.json names."""
    from transformers import AutoModelForCausalLM

    if base is None and recipe is not None and recipe.model.init == "random":
        from shardtune.model.build import build_model

        return build_model(recipe.model, seed=recipe.train.seed), None  # the seeded weights the run started from
    if base is None and recipe is not None:
        from shardtune.hub import EVERYTHING, model_dir

        base = model_dir(recipe.model.path, EVERYTHING)
    elif base is None:
        base = _named_base(folder)
    return AutoModelForCausalLM.from_pretrained(base, local_files_only=True), base


def _named_base(folder: Path) -> Path:
    """The base an adapter away from its run names (base_model_name_or_path): a local model folder, else one line
    saying how to give it."""
    named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not named:
        raise UserError(f"generate: '{folder}' is a LoRA adapter whose adapter_config.json names no base model "
                        "(base_model_name_or_path is null: its run started from a random init) and no recipe.yaml "
                        "is beside or above it: give the run directory, or pass --base MODEL_FOLDER")
    path = Path(named).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"generate: the base model '{named}' that '{folder}/adapter_config.json' names is not a "
                        "local model folder: pass --base MODEL_FOLDER (the model it was trained over, with its "
                        "config.json and weights)")
    return path


def _device(device: str) -> torch.device:
    import torch
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: choose auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible here: use --device cpu")
    return torch.device(device)


def render(loaded: Loaded, prompt: str, history: list[dict[str, str]] | None = None, *,
           system: str | None = None) -> str:
    """The text the model continues, in the shape of its training data. `system` opens a chat; a model trained
    on single prompts has no place for it (warned, left out)."""
    tok, style = loaded.tok, loaded.style
    if style.kind == "chat":
        if not tok.chat_template:
            raise UserError("generate: the run trained on chat data but the tokenizer has no chat template: set "
                            "model.chat_template in the recipe")
        opening = [{"role": "system", "content": system}] if system is not None else []
        messages = [*opening, *(history or []), {"role": "user", "content": prompt}]
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if system is not None:
        import warnings

        warnings.warn(f"--system is ignored: the model was trained on {style.kind} prompts, which have no system "
                      "message", stacklevel=2)
    if style.kind == "instruction":
        from shardtune.templates import render_prompt

        return (tok.bos_token or "") + render_prompt(style.template or "plain", prompt)
    return (tok.bos_token or "") + prompt


def complete(loaded: Loaded, text: str, s: Sampling) -> str:
    """One completion. The seed is set per call: the same prompt and seed give the same sample. A chat reply ends
    at EOS or at the chat template's end of turn (chatml's `<|im_end|>`: what the run was trained to emit there)."""
    import torch

    from shardtune.model.attention_mask import generation_attention

    tok, model = loaded.tok, loaded.model
    enc = tok(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    torch.manual_seed(s.seed)
    sample = s.temperature > 0
    stop = turn_end(loaded)
    with torch.no_grad(), generation_attention(model):  # a KV cache: transformers' SDPA (model/attention_mask.py)
        out = model.generate(**enc, max_new_tokens=new_tokens(loaded, enc["input_ids"].shape[1], s), do_sample=sample,
                             temperature=s.temperature if sample else None, top_p=s.top_p if sample else None,
                             top_k=None, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             **({"stop_strings": [stop], "tokenizer": tok} if stop else {}))
    reply = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return reply.split(stop, 1)[0] if stop else reply


def new_tokens(loaded: Loaded, prompt_tokens: int, s: Sampling) -> int:
    """--max-new-tokens, within the positions the model was built for (max_position_embeddings): past them a
    rotary model runs on untrained positions (transformers only warns) and a long budget decodes for minutes. A
    prompt that fills them is a UserError."""
    limit = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
    if limit is None or prompt_tokens + s.max_new_tokens <= limit:
        return s.max_new_tokens
    if prompt_tokens >= limit:
        raise UserError(f"generate: the prompt is {prompt_tokens:,} tokens and the model reads at most {limit:,} "
                        "(max_position_embeddings): shorten it (in chat, /reset starts over)")
    if not s.warned:
        print(f"warning: --max-new-tokens {s.max_new_tokens:,} goes past the model's {limit:,} positions: each reply "
              f"stops there ({limit - prompt_tokens:,} new tokens after this prompt)", file=sys.stderr)
        s.warned = True
    return limit - prompt_tokens


def turn_end(loaded: Loaded) -> str | None:
    """The text a chat template writes after an assistant's message (stripped; a bare newline stays), found by
    rendering one; None for runs not trained on chats."""
    if loaded.style.kind != "chat" or not loaded.tok.chat_template:
        return None
    sentinel = "\x00reply\x00"
    try:
        text = loaded.tok.apply_chat_template([{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": sentinel}], tokenize=False)
    except Exception:  # noqa: BLE001 (a template with rules of its own, e.g. no bare user turn): EOS alone ends it
        return None
    if sentinel not in text:
        return None
    after = text.split(sentinel, 1)[1]
    return after.strip() or (after[:1] if after else None)


def chat_loop(loaded: Loaded, s: Sampling, stdin: Any = sys.stdin, stdout: Any = sys.stdout, *,
              system: str | None = None) -> None:
    """One reply per input line until EOF or /exit. Chat-trained models keep the conversation; others answer each
    line alone (they were trained on single prompts). /reset forgets the conversation (the system message stays)."""
    keeps = loaded.style.kind == "chat"
    tty = stdin.isatty()
    history: list[dict[str, str]] = []
    if tty:
        print("type a message, /reset to start over, /exit or Ctrl-D to leave", file=stdout)
    while True:
        if tty:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return
        prompt = line.rstrip("\n")
        if prompt.strip() == "/reset":
            history = []
            continue
        try:
            reply = complete(loaded, render(loaded, prompt, history if keeps else None, system=system), s)
        except UserError as e:  # the conversation outgrew the model's positions: say so, keep the session
            print(f"error: {e}", file=sys.stderr, flush=True)
            continue
        print(reply, file=stdout, flush=True)
        if keeps:
            history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
