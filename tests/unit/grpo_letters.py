"""A dense reward for GRPO tests at random init (TRL's signature): the share of a completion's characters that are
the reversal task's letters. Random completions score anywhere in [0, 1], so groups are rarely ties."""


def letters(completions, **kwargs):
    return [sum(ch in "abcdefgh" for ch in c) / max(len(c), 1) for c in completions]
