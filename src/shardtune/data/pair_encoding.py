"""Preference rows -> (prompt, chosen, rejected) token ids, and the truncation that keeps what DPO compares.

Each value is a string, or a chat message list (the prompt a list of messages, chosen and rejected the assistant
turn(s) that follow it, rendered with the tokenizer's chat template). A string prompt is rendered with data.template
(plain: the prompt and a newline), as format=instruction renders it. Rows without a prompt column are TRL's
implicit-prompt layout: the opening turns both conversations share are the prompt.

Truncation: when prompt + the longer response exceed seq_len, the prompt keeps its END (the tokens next to the
answer) and at least min(len(prompt), seq_len // 2) of them; both responses keep their START, cut to the same budget
seq_len - kept prompt, so the two documents of a pair share one prompt.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from shardtune.config.schema import DataConfig
from shardtune.data.messages import check_tool_calls, to_messages
from shardtune.data.tokens import IGNORE, as_ids
from shardtune.errors import UserError
from shardtune.templates import render_prompt

Encoded = list[tuple[list[int], list[int]]]  # per row: (input ids, labels)


def truncate_pair(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int
                  ) -> tuple[list[int], list[int], list[int], bool]:
    """See the module docstring. Returns (prompt, chosen, rejected, truncated)."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= seq_len:
        return prompt, chosen, rejected, False
    keep = max(seq_len - longest, min(len(prompt), seq_len // 2))
    budget = seq_len - keep
    return prompt[len(prompt) - keep :], chosen[:budget], rejected[:budget], True


def ignored_template(row: dict[str, Any], cfg: DataConfig) -> str | None:
    """The warning for a data.template set on conversational pairs (their chat template renders them), else None."""
    if cfg.template == "plain":  # the default: nothing was asked for
        return None
    prompt = row.get(cfg.prompt_field) if cfg.prompt_field else row.get(cfg.chosen_field)
    if not isinstance(prompt, list):
        return None
    return (f"data.template={cfg.template} is ignored: these preference rows are conversations, rendered with the "
            "tokenizer's chat template (model.chat_template); data.template renders string prompts")


def split_shared_prompt(chosen: Any, rejected: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """TRL's implicit prompt: chosen and rejected are two conversations; the turns they open with in common are
    the prompt, the rest of each its response (as trl.extract_prompt splits them)."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise UserError("data.format=preference: rows without a prompt column need chosen and rejected as "
                        "conversations (message lists) sharing their opening turns: add a prompt column "
                        "(data.prompt_field) for text values")
    shared = next((i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r), min(len(chosen), len(rejected)))
    if shared == 0:
        raise UserError("data.format=preference: a row's chosen and rejected conversations share no opening turn, "
                        "so no prompt can be taken from them: add a prompt column (data.prompt_field)")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _text_ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def encode_pair(row: dict[str, Any], cfg: DataConfig, tok: PreTrainedTokenizerBase
                ) -> tuple[list[int], list[int], list[int]]:
    """One row -> (prompt ids, chosen ids, rejected ids), untruncated."""
    chosen, rejected = row[cfg.chosen_field], row[cfg.rejected_field]
    prompt = row[cfg.prompt_field] if cfg.prompt_field else None
    if not cfg.prompt_field:
        prompt, chosen, rejected = split_shared_prompt(chosen, rejected)
    if isinstance(prompt, list):  # chat: the responses are the assistant turn(s) after the prompt's messages
        if not tok.chat_template:
            raise UserError("data.format=preference: message-list rows need a tokenizer with a chat template: "
                            "use string values or another tokenizer")
        prompt = to_messages(prompt, cfg.chat_style)  # ShareGPT turns, content lists: as the chat format reads them
        check_tool_calls(prompt, tok)
        before = as_ids(tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
        out = [before]
        for resp in (chosen, rejected):
            turns = to_messages(resp, cfg.chat_style) if isinstance(resp, list) else \
                [{"role": "assistant", "content": str(resp)}]
            check_tool_calls(prompt + turns, tok)
            full = as_ids(tok.apply_chat_template(prompt + turns, tokenize=True))
            if full[: len(before)] != before:
                raise UserError("data.format=preference: the chat template does not render the response after "
                                "the prompt as a prefix: use string values for this tokenizer")
            out.append(full[len(before):])
        return out[0], out[1], out[2]
    # A string prompt is rendered with data.template exactly as format=instruction renders it (templates.py), so a
    # DPO run that starts from an SFT run's final/ sees its prompts in the shape the SFT run trained on.
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return (bos + _text_ids(tok, render_prompt(cfg.template, str(prompt))), _text_ids(tok, str(chosen)) + eos,
            _text_ids(tok, str(rejected)) + eos)



def encode_preference(batch: dict[str, list[Any]], cfg: DataConfig, tok: PreTrainedTokenizerBase) -> Encoded:
    """Two documents per row, prompt + chosen then prompt + rejected, prompt masked and truncated as training
    stores them. Training builds pairs with data/preference.py (its own layout: never packed); this encoder is
    what `validate` samples."""
    out: Encoded = []
    prompts = batch[cfg.prompt_field] if cfg.prompt_field else [None] * len(batch[cfg.chosen_field])
    for row in zip(prompts, batch[cfg.chosen_field], batch[cfg.rejected_field]):
        values = dict(zip((cfg.prompt_field, cfg.chosen_field, cfg.rejected_field), row))
        p, c, r, _ = truncate_pair(*encode_pair(values, cfg, tok), cfg.seq_len)
        out += [(p + resp, [IGNORE] * len(p) + resp) for resp in (c, r)]
    return out
