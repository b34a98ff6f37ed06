"""`data.format: prompt` (GRPO): a row's prompt -> the token ids the policy continues, and the checks of its value.

TRL's prompt-only layouts: `prompt` is a string, rendered with data.template after bos exactly as format=instruction
and preference's string prompts are (templates.py), so a GRPO run that starts from an SFT run's final/ sees its
prompts in the shape it trained on; or a list of messages, rendered with the chat template and the generation
prompt (the assistant's turn opened, as generation needs it). Every other column is kept for the reward
functions. Lightweight (no numpy/pyarrow): formats.py registers `encode_prompts` for validate's sample.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data.messages import TOOLS_COLUMN, check_tool_calls, row_tools, to_messages
from shardtune.data.tokens import IGNORE, as_ids
from shardtune.errors import UserError
from shardtune.templates import render_prompt

Encoded = list[tuple[list[int], list[int]]]  # per row: (input ids, labels)


def prompt_problem(value: Any, cfg: DataConfig) -> str | None:
    """What makes a prompt value unusable (one clause with its fix), or None."""
    if value is None:
        return "missing or null: every row needs a prompt"
    if isinstance(value, list):
        try:
            to_messages(value, cfg.chat_style)
        except UserError as e:
            return str(e).removeprefix("data.format=chat: ")
        return None if value else "an empty message list: give the prompt's turns"
    if isinstance(value, dict):
        return "holds a dict, expected text or a list of messages: map data.prompt_field to the prompt column"
    return None


def prompt_value(value: Any, cfg: DataConfig) -> str | list[dict[str, Any]]:
    """The prompt as the reward functions receive it (TRL's `prompts`): the string, or the messages (ShareGPT
    turns read as OpenAI ones)."""
    return to_messages(value, cfg.chat_style) if isinstance(value, list) else str(value)


def encode_prompt(value: Any, cfg: DataConfig, tok: PreTrainedTokenizerBase, tools: Any = None) -> list[int]:
    """One prompt -> its token ids, uncut. Raises UserError for a value it cannot render."""
    problem = prompt_problem(value, cfg)
    if problem:
        raise UserError(problem)
    prompt = prompt_value(value, cfg)
    if isinstance(prompt, list):
        if not tok.chat_template:
            raise UserError("message-list prompts need a chat template: set model.chat_template=chatml (or plain, "
                            "or a Jinja string), or use string prompts")
        schemas = row_tools(tools)
        check_tool_calls(prompt, tok, schemas)
        return as_ids(tok.apply_chat_template(prompt, tools=schemas, tokenize=True, add_generation_prompt=True))
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return bos + tok(render_prompt(cfg.template, prompt), add_special_tokens=False)["input_ids"]


def ignored_template(value: Any, cfg: DataConfig) -> str | None:
    """The warning for a data.template set on conversational prompts (their chat template renders them)."""
    if cfg.template == "plain" or not isinstance(value, list):
        return None
    return (f"data.template={cfg.template} is ignored: these prompts are conversations, rendered with the "
            "tokenizer's chat template (model.chat_template); data.template renders string prompts")


def encode_prompts(batch: dict[str, list[Any]], cfg: DataConfig, tok: PreTrainedTokenizerBase) -> Encoded:
    """Each row's prompt ids, uncut, with no target (generation writes the completions): what `validate`
    samples. Training stores them with data/prompts.py."""
    values = batch[cfg.prompt_field]
    tools = batch.get(TOOLS_COLUMN) or [None] * len(values)
    out: Encoded = []
    for value, t in zip(values, tools):
        ids = encode_prompt(value, cfg, tok, t)
        out.append((ids, [IGNORE] * len(ids)))
    return out
