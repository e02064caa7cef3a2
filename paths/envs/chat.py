"""Chat prompts: messages rendered with the run tokenizer's chat template, and model turns read back.

A prompt that is a list of messages (`[{"role": "user", "content": "..."}]`, the form verifiers and
chat datasets use) is rendered with the tokenizer's own template, or one given with
`--chat-template FILE`; `--system-prompt` puts a system message first. The tokenizers `paths init`
trains carry `MINIMAL_TEMPLATE`, so tiny runs need no download: each message is `<|role|>`, a
newline, its content and EOS; tool calls are written `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` (the Hermes / Qwen form most templates use) and read back by `tool_calls`.
"""

from __future__ import annotations

import json
import hashlib
import re
from typing import Any

from paths.errors import ConfigurationError, DataError

ROLES = ("system", "user", "assistant", "tool")
MINIMAL_TEMPLATE = (
    "{%- if tools %}<|system|>\nTools: {% for t in tools %}{{ t['function']['name'] }}({{ t['function']['parameters']['properties'] | list | join(', ') }})"
    "{% if not loop.last %}; {% endif %}{% endfor %}. Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.{{ eos_token }}\n{% endif -%}"
    "{%- for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% elif m['content'] %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {% if c['function']['arguments'] is mapping %}{{ c['function']['arguments'] | tojson }}{% else %}{{ c['function']['arguments'] }}{% endif %}}</tool_call>{% endfor %}"
    "{{ eos_token }}\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """A list of {"role", "content"} messages with known roles, or a one-line DataError."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: a chat prompt must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: message {i} is not an object with a role: write {{\"role\": \"user\", \"content\": \"...\"}}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has unknown role {m['role']!r}: use one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise DataError(f"{where}: message {i} has content of type {type(content).__name__}: give text")
    return messages


def with_system(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """The messages with `system_prompt` first, unless they already start with a system message."""
    if not system_prompt or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def template_of(tokenizer: Any, template: str | None, what: str) -> str:
    """The chat template to render with: the one given, else the tokenizer's; an error if neither."""
    chosen = template or getattr(tokenizer, "chat_template", None)
    if not chosen:
        raise ConfigurationError(f"{what} has chat prompts but the run's tokenizer has no chat template: pass --chat-template FILE (a Jinja template)")
    return chosen


def render(tokenizer: Any, messages: list[dict[str, Any]], template: str, tools: list[dict[str, Any]] | None = None, generation: bool = True) -> str:
    """The conversation as the model sees it, ending with the assistant's header when `generation`."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=template, tokenize=False, add_generation_prompt=generation)
    except Exception as exc:  # a template that cannot render these messages: say so in one line
        raise DataError(f"the chat template cannot render these messages ({type(exc).__name__}: {' '.join(str(exc).split())}): fix the template or the prompt") from None


def tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """A model turn split into its text and its tool calls (OpenAI form; arguments as JSON text).

    A call that is not valid JSON stays in the text: the environment sees no call and answers the
    turn as it would any other."""
    calls = []
    for i, m in enumerate(_TOOL_CALL.finditer(text)):
        try:
            body = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        args = body.get("arguments", {})
        call_id = "call_" + hashlib.sha256(f"{i}\0{text}".encode()).hexdigest()[:12]  # the same turn, the same ids
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": body["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    content = _TOOL_CALL.sub("", text).strip() if calls else text
    return content, calls
