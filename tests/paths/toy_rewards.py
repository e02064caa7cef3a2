"""User rewards for the GRPO tests (imported as module:function, as a user's would be)."""


def even_first_char(prompts, completions, answers):
    """1 when the completion's first character has an even code point: about half of all tokens."""
    return [1.0 if c and ord(c[0]) % 2 == 0 else 0.0 for c in completions]


def wrong_length(prompts, completions, answers):
    return [1.0]


def not_a_number(prompts, completions, answers):
    return [float("nan")] * len(completions)


NOT_CALLABLE = 3


def level_one_only(prompts, completions, completion_ids, level, **kwargs):
    """TRL's keyword convention, reading the record's `level` field: the even-first-character
    reward on level-1 prompts, a constant (no signal) on the others."""
    return [(1.0 if c and ord(c[0]) % 2 == 0 else 0.0) if lv == 1 else 0.5 for c, lv in zip(completions, level)]


def always_one(prompts, completions, answers):
    return [1.0] * len(completions)


def never_applies(prompts, completions, completion_ids, **kwargs):
    return [None] * len(completions)
