"""Chat rows as OpenAI messages ({role, content}), whichever way the data writes them: OpenAI's turns, ShareGPT's
{from, value}, content as a string or as a list of text parts. The chat and preference formats both read turns
through `to_messages`, so a conversation renders the same in either."""
from __future__ import annotations

import json
from typing import Any

from shardtune.errors import UserError

# ShareGPT's speaker names -> OpenAI roles (the names seen in the wild: human/gpt, user/assistant, system).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "bot": "assistant", "model": "assistant", "tool": "tool"}
ROLES = ("system", "user", "assistant", "tool")
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # kept on a message when the data has them
TOOLS_COLUMN = "tools"  # TRL's column of the function schemas a row's assistant may call, passed to the template


def as_text(x: Any) -> str:
    return "" if x is None else str(x)


def to_messages(turns: Any, style: str = "auto") -> list[dict[str, Any]]:
    """One row's turns as OpenAI messages. openai: {role, content}; sharegpt: {from, value} with human/gpt/system;
    auto: either, per turn. Raises UserError naming the keys it expected."""
    if not isinstance(turns, (list, tuple)):
        raise UserError(f"data.format=chat: a row's turns must be a list of messages, got {type(turns).__name__}: "
                        "set data.messages_field to the column holding them")
    out = []
    for t in turns:
        if not isinstance(t, dict):
            raise UserError(f"data.format=chat: a turn must be a mapping, got {t!r:.60}")
        # Arrow gives every turn of a column all the keys any turn has (missing ones None): test values, not keys
        if style != "sharegpt" and t.get("role") is not None and "content" in t:
            role, content = t["role"], t["content"]
        elif style != "openai" and t.get("from") is not None and "value" in t:
            role = SHAREGPT_ROLES.get(str(t["from"]).lower(), t["from"])
            content = t["value"]
        else:
            keys = {"openai": "{role, content}", "sharegpt": "{from, value}"}.get(style, "{role, content} (OpenAI) "
                                                                               "or {from, value} (ShareGPT)")
            raise UserError(f"data.format=chat: a turn has keys {sorted(k for k, v in t.items() if v is not None)}, expected {keys}: set data.chat_style "
                            "(auto, openai, sharegpt) to match the data")
        if role not in ROLES:
            raise UserError(f"data.format=chat: unknown role {role!r}: expected {', '.join(ROLES)} (or ShareGPT's "
                            "human, gpt, system)")
        message: dict[str, Any] = {"role": role, "content": _content_text(content)}
        # OpenAI's tool calling, as TRL passes it to the template: the assistant's calls, the tool reply's call id
        message.update({k: t[k] for k in TOOL_KEYS if t.get(k) not in (None, [])})
        out.append(message)
    return out


def row_tools(value: Any) -> list[dict[str, Any]] | None:
    """A row's TOOLS_COLUMN as the chat template takes it: None when empty, a JSON string parsed, and the nulls Arrow
    fills into schemas of other shapes (every key any row's schema has) removed."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise UserError(f"data.format=chat: a row's {TOOLS_COLUMN} column is not JSON ({value[:60]!r}): give "
                            "a list of function schemas, as a list or a JSON string") from None
    return [_without_nulls(t) for t in (value if isinstance(value, list) else [value])]


def _without_nulls(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _without_nulls(v) for k, v in x.items() if v is not None}
    return [_without_nulls(v) for v in x] if isinstance(x, list) else x


def check_tool_calls(messages: list[dict[str, Any]], tok: Any, tools: list[dict[str, Any]] | None = None) -> None:
    """A chat template that ignores `tool_calls` (chatml, plain, many models' own) would train each calling turn as
    an empty reply, and one that ignores `tools` would train calls to functions the prompt never defines: refused,
    naming the fix. `tok`: the tokenizer whose template renders the rows."""
    def render(msgs: list[dict[str, Any]], with_tools: list[dict[str, Any]] | None) -> str:
        return tok.apply_chat_template(msgs, tools=with_tools, tokenize=False)

    if any("tool_calls" in m for m in messages):
        bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        if render(messages, tools) == render(bare, tools):
            raise UserError("data.format=chat: the rows hold assistant tool_calls but the chat template does not "
                            "render them (each calling turn would train as an empty reply): set model.chat_template "
                            "to a template that writes tool calls (the model's own, if it was trained with tools), "
                            "or drop the tool turns from the data")
    if tools and render(messages, tools) == render(messages, None):
        raise UserError(f"data.format=chat: the rows have a {TOOLS_COLUMN} column but the chat template does not "
                        "render it (calls would train without the functions' definitions): set model.chat_template "
                        f"to a template that lists tools (the model's own, if it was trained with them), or drop the "
                        f"{TOOLS_COLUMN} column")


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a content list (OpenAI's and TRL's
    [{"type": "text", "text": ...}], joined). Another part (an image) is refused: these models read text only."""
    if not isinstance(content, (list, tuple)):
        return as_text(content)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise UserError(f"data.format=chat: a message's content list has a {kind!r} part: only text parts "
                            "({type: text, text: ...}) are trained on; drop the others from the data")
        texts.append(as_text(part.get("text")))
    return "".join(texts)
