"""generation_config.json beside an exported full model: what `from_pretrained(...).generate()` reads for when to
stop and what to pad with. Without it transformers falls back on the model config alone, which may name no eos (an
architecture file) or another one than the tokenizer the run trained with: replies would run to max_new_tokens."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedTokenizerBase

GENERATION_CONFIG = "generation_config.json"


def with_tokenizer_ids(gen: GenerationConfig, tok: PreTrainedTokenizerBase | None) -> GenerationConfig:
    """A copy of `gen` that also stops at the tokenizer's eos (the model's own stop ids kept: an instruct model
    names several), and pads and begins with the tokenizer's ids where `gen` names none."""
    gen = copy.deepcopy(gen)
    if tok is None:
        return gen
    eos = gen.eos_token_id
    stops = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tok.eos_token_id is not None and tok.eos_token_id not in stops:
        stops.append(tok.eos_token_id)
    gen.eos_token_id = stops[0] if len(stops) == 1 else (stops or None)
    if gen.pad_token_id is None:
        gen.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if gen.bos_token_id is None:
        gen.bos_token_id = tok.bos_token_id
    return gen


def write_generation_config(folder: Path) -> None:
    """Into a model folder (config.json, tokenizer files): one built from the model config and the tokenizer's ids.
    One already there is kept: it is the model's own (its sampling defaults), written at training time."""
    if (folder / GENERATION_CONFIG).is_file():
        return
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder, local_files_only=True))
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):  # no tokenizer beside the weights: the model config's ids alone
        tok = None
    with_tokenizer_ids(gen, tok).save_pretrained(folder)
