"""User rewards for the GRPO tests (imported as module:function, as a user's would be)."""


def even_first_char(prompts, completions, answers):
    """1 when the completion's first character has an even code point: about half of all tokens."""
    return [1.0 if c and ord(c[0]) % 2 == 0 else 0.0 for c in completions]


def wrong_length(prompts, completions, answers):
    return [1.0]


def not_a_number(prompts, completions, answers):
    return [float("nan")] * len(completions)


NOT_CALLABLE = 3
