"""Raw rows -> token ids + labels, per `data.format`. Labels are -100 where no loss is taken.

One encoder per format, registered in FORMATS with the columns it reads (named by their data.* keys). A new format
is one function plus one registry line; `fields.py` maps and checks its columns, `build.py` stores the result.
Every encoder takes a column batch (what `datasets.map(batched=True)` hands over) whose fields are already
resolved (`fields.resolve_fields`): the DataConfig names columns that exist.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: the launcher's data pre-flight reads files without transformers (~2 s)
    from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data.messages import TOOLS_COLUMN, check_tool_calls, row_tools, to_messages
from shardtune.data.messages import as_text as _text
from shardtune.data.pair_encoding import Encoded, encode_preference
from shardtune.data.prompt_encoding import encode_prompts
from shardtune.data.tokens import IGNORE, as_ids
from shardtune.errors import UserError
from shardtune.templates import render_prompt


class _NoLengthWarning(logging.Filter):
    """transformers warns when a tokenized text is longer than the tokenizer's model_max_length ("Token indices
    sequence length is longer than..."): shardtune truncates or splits every document to data.seq_len itself
    (data.long_docs), and validate checks seq_len against the model, so the warning only misleads."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token indices sequence length is longer than")


logging.getLogger("transformers.tokenization_utils_base").addFilter(_NoLengthWarning())

@dataclass(frozen=True)
class Format:
    encode: Callable[[dict[str, list[Any]], DataConfig, PreTrainedTokenizerBase], Encoded]
    required: tuple[str, ...]  # data.* keys naming columns that must exist
    optional: tuple[str, ...] = ()  # data.* keys naming columns used when present


def _ids(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return tok(texts, add_special_tokens=False)["input_ids"]


def _specials(tok: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    return ([tok.bos_token_id] if tok.bos_token_id is not None else [],
            [tok.eos_token_id] if tok.eos_token_id is not None else [])


def encode_text(batch: dict[str, list[Any]], cfg: DataConfig, tok: PreTrainedTokenizerBase) -> Encoded:
    """Every token is a target (plain language modelling)."""
    bos, eos = _specials(tok)
    out = []
    for ids in _ids(tok, [_text(t) for t in batch[cfg.text_field]]):
        ids = bos + ids + eos
        out.append((ids, list(ids)))
    return out


def encode_instruction(batch: dict[str, list[Any]], cfg: DataConfig, tok: PreTrainedTokenizerBase) -> Encoded:
    """bos + the template's prompt text (with the input, if any) | response + eos; the prompt part is masked unless
    data.train_on_inputs. The template ends in a separator, so the model sees where the answer starts."""
    bos, eos = _specials(tok)
    n = len(batch[cfg.prompt_field])
    inputs = batch[cfg.input_field] if cfg.input_field in batch else [""] * n
    prompts = [render_prompt(cfg.template, _text(p), _text(i)) for p, i in zip(batch[cfg.prompt_field], inputs)]
    out = []
    for p, r in zip(_ids(tok, prompts), _ids(tok, [_text(r) for r in batch[cfg.response_field]])):
        prompt, response = bos + p, r + eos
        labels = prompt + response if cfg.train_on_inputs else [IGNORE] * len(prompt) + response
        out.append((prompt + response, labels))
    return out


def encode_chat(batch: dict[str, list[Any]], cfg: DataConfig, tok: PreTrainedTokenizerBase) -> Encoded:
    """Rendered with the tokenizer's chat template (or model.chat_template), row by row. Rows in TRL's
    conversational prompt/completion layout (fields.py leaves messages_field empty for them) take the loss on the
    completion's tokens only, whatever roles the prompt holds."""
    if not cfg.messages_field:
        rows = batch[cfg.prompt_field]
        tools = batch.get(TOOLS_COLUMN) or [None] * len(rows)
        return [_encode_prompt_completion(to_messages(p, cfg.chat_style), to_messages(c, cfg.chat_style), tok,
                                          train_on_inputs=cfg.train_on_inputs, tools=row_tools(t))
                for p, c, t in zip(rows, batch[cfg.response_field], tools)]
    rows = batch[cfg.messages_field]
    tools = batch.get(TOOLS_COLUMN) or [None] * len(rows)
    return [_encode_chat(to_messages(m, cfg.chat_style), tok, train_on_inputs=cfg.train_on_inputs, tools=row_tools(t))
            for m, t in zip(rows, tools)]


FORMATS: dict[str, Format] = {
    "text": Format(encode_text, ("text_field",)),
    "instruction": Format(encode_instruction, ("prompt_field", "response_field"), ("input_field",)),
    "chat": Format(encode_chat, ("messages_field",)),
    "preference": Format(encode_preference, ("prompt_field", "chosen_field", "rejected_field")),
    "prompt": Format(encode_prompts, ("prompt_field",)),  # GRPO: prompts only, other columns for the rewards
}


def encode_batch(batch: dict[str, list[Any]], cfg: DataConfig, tok: PreTrainedTokenizerBase) -> Encoded:
    """The format's encoder over a column batch. Text and instruction call the fast tokenizer once per batch (Rust,
    ~10x fewer Python calls than row by row); chat renders row by row."""
    return FORMATS[cfg.format].encode(batch, cfg, tok)


def encode_row(row: dict[str, Any], cfg: DataConfig, tok: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    return encode_batch({k: [v] for k, v in row.items()}, cfg, tok)[0]


def _encode_chat(messages: list[dict[str, Any]], tok: PreTrainedTokenizerBase, *, train_on_inputs: bool = False,
                 tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """Only assistant turns are trained (all tokens with train_on_inputs). Works with any chat template: each
    assistant turn's tokens are the difference between the rendering up to it (with the generation prompt) and the
    rendering including it."""
    if not tok.chat_template:
        raise UserError("data.format=chat: the tokenizer has no chat template: set model.chat_template=chatml (or "
                        "plain, or a Jinja string), or use data.format=instruction")
    check_tool_calls(messages, tok, tools)
    ids: list[int] = []
    labels: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = as_ids(tok.apply_chat_template(messages[:i], tools=tools, tokenize=True, add_generation_prompt=True))
        after = as_ids(tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=True))
        if after[: len(before)] != before:
            raise UserError("data.format=chat: the chat template does not render turns as a prefix: "
                            "set model.chat_template=chatml or use data.format=instruction")
        labels += [IGNORE] * (len(before) - len(ids)) + after[len(before):]
        ids = after
    if not ids:  # no assistant turn: nothing to learn from this row
        return [], []
    return ids, list(ids) if train_on_inputs else labels


def _encode_prompt_completion(prompt: list[dict[str, Any]], completion: list[dict[str, Any]],
                              tok: PreTrainedTokenizerBase, *, train_on_inputs: bool = False,
                              tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """The prompt rendered with the generation prompt, then prompt + completion: the tokens after the first
    rendering are the targets (as TRL's SFTTrainer builds its completion mask)."""
    if not tok.chat_template:
        raise UserError("data.format=chat: the tokenizer has no chat template: set model.chat_template=chatml (or "
                        "plain, or a Jinja string)")
    check_tool_calls(prompt + completion, tok, tools)
    before = as_ids(tok.apply_chat_template(prompt, tools=tools, tokenize=True, add_generation_prompt=True))
    ids = as_ids(tok.apply_chat_template(prompt + completion, tools=tools, tokenize=True))
    if ids[: len(before)] != before:
        raise UserError("data.format=chat: the chat template does not render the completion after the prompt as a "
                        "prefix: set model.chat_template=chatml")
    return ids, list(ids) if train_on_inputs else [IGNORE] * len(before) + ids[len(before):]
