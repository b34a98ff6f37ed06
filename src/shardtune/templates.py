"""Prompt templates (`data.template`, format=instruction) and chat templates (`model.chat_template`, format=chat).

The one place both training data and generation render a prompt, so the model is asked at inference exactly in
the shape it was trained on. Stable API (the `generate`/`chat` commands import it):

- `PROMPT_TEMPLATES`: bundled prompt template names -> (without input, with input).
- `render_prompt(template, prompt, input="")`: the text that precedes the response.
- `CHAT_TEMPLATES`: bundled Jinja chat templates by name.
- `chat_template_source(setting)`: a bundled name or a Jinja string -> the Jinja string.
- `resolve_chat_template(tokenizer_template, setting)`: the template to use (the setting wins, else the tokenizer's).
- `render_chat(messages, template, add_generation_prompt=False, **special_tokens)`: a chat rendered as text.

Placeholders are replaced literally (`{prompt}`, `{input}`), not with `str.format`: braces in a template or in the
data (JSON, code) are left alone.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_PLACEHOLDER = re.compile(r"\{prompt\}|\{input\}")
SEPARATOR = "\n"  # appended to a template that would put the response right after the user's text

# name -> (template without an input, template with an input). Each ends with a separator: the model must see
# where the prompt stops and the answer starts.
PROMPT_TEMPLATES: dict[str, tuple[str, str]] = {
    "plain": ("{prompt}\n", "{prompt}\n\n{input}\n"),
    "alpaca": (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\n{prompt}\n\n### Response:\n",
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\n{prompt}\n\n"
        "### Input:\n{input}\n\n### Response:\n",
    ),
    "chatml": ("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\n{prompt}\n\n{input}<|im_end|>\n<|im_start|>assistant\n"),
}

CHAT_TEMPLATES: dict[str, str] = {
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    # role-prefixed lines, for tokenizers without special chat tokens
    "plain": ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"),
}


def check_prompt_template(template: str) -> str | None:
    """None when `template` is a bundled name or a string with `{prompt}`; else what is wrong (for the error)."""
    if template in PROMPT_TEMPLATES or "{prompt}" in template:
        return None
    return (f"'{template}' is neither a bundled template ({', '.join(sorted(PROMPT_TEMPLATES))}) nor a string "
            "with {prompt} (and optionally {input})")


def prompt_template(template: str, *, with_input: bool) -> str:
    """The template string for one row. A user string ending in a placeholder gets SEPARATOR appended."""
    if template in PROMPT_TEMPLATES:
        return PROMPT_TEMPLATES[template][1 if with_input else 0]
    assert check_prompt_template(template) is None, template
    if "{input}" not in template and with_input:  # a custom template without {input}: the input follows the prompt
        template = template.replace("{prompt}", "{prompt}\n\n{input}", 1)
    if template.endswith(("{prompt}", "{input}")):
        template += SEPARATOR
    return template


def render_prompt(template: str, prompt: str, input: str = "") -> str:  # noqa: A002 (Alpaca's column name)
    """The text before the response: `template` (a bundled name or a string) filled with the row's fields."""
    text = prompt_template(template, with_input=bool(input))
    values = {"{prompt}": prompt, "{input}": input}
    # one pass over the template: a field's own text ("{prompt}" inside an input) is never substituted again
    return _PLACEHOLDER.sub(lambda m: values[m.group(0)], text)  # a custom {input} with no input: empty


def chat_template_source(setting: str) -> str:
    """A bundled chat template's Jinja text, or `setting` itself when it is a Jinja string."""
    if setting in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[setting]
    if "{%" in setting or "{{" in setting:
        return setting
    raise ValueError(f"'{setting}' is neither a bundled chat template ({', '.join(sorted(CHAT_TEMPLATES))}) nor a "
                     "Jinja string")


def resolve_chat_template(tokenizer_template: str | None, setting: str | None) -> str | None:
    """`model.chat_template` when set (an explicit choice wins), else the tokenizer's own, else None."""
    return chat_template_source(setting) if setting else tokenizer_template


def render_chat(messages: list[dict[str, str]], template: str, *, add_generation_prompt: bool = False,
                **special_tokens: Any) -> str:
    """A chat as text with `template` (a bundled name or a Jinja string), the way HF's `apply_chat_template` renders
    it (same sandboxed Jinja environment options). `special_tokens`: bos_token, eos_token, ... as the template
    expects them."""
    return _compiled(chat_template_source(template)).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                            **special_tokens)


@lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
