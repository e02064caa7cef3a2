"""The policy as verifiers expects to reach a model: an in-process chat client (no HTTP).

verifiers' environments call `client.get_response(prompt=messages, tools=...)` once per model turn.
`LocalClient(responder)` answers with `await responder.respond(episode, messages, tools)` (the
path's own sampler: `paths.work.episodes.Turns`), which returns the turn's text, its tool calls,
and the exact prompt and completion token ids with their log-probs, so verifiers' trajectory holds
what was sampled.
"""

from __future__ import annotations

import json
import time
from typing import Any


def _client_base() -> type:
    from verifiers.legacy.clients.client import Client

    return Client


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)  # chat templates (and ours) take the arguments as an object
    except json.JSONDecodeError:
        return text


def LocalClient(turns: Any) -> Any:  # noqa: N802 - a class made once verifiers is importable
    """A verifiers `Client` whose model is `turns` (None: a client for scoring only, never asked to sample)."""
    global _LocalClient
    if _LocalClient is None:
        _LocalClient = _make_client_class()
    return _LocalClient(turns)


_LocalClient: type | None = None


def _make_client_class() -> type:
    from verifiers.legacy.types import Response, ResponseMessage, ResponseTokens, ToolCall, Usage

    class _Client(_client_base()):  # type: ignore[misc]
        def __init__(self, turns: Any):
            super().__init__(None)  # not a ClientConfig: no network client is set up
            self.turns = turns

        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> dict[str, Any]:
            return {"type": "function", "function": {"name": tool.name, "description": tool.description or "", "parameters": tool.parameters or {}}}

        async def to_native_prompt(self, messages: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            out = []
            for m in messages:
                d: dict[str, Any] = {"role": m.role, "content": m.content if m.content is not None else ""}
                if getattr(m, "tool_calls", None):
                    d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in m.tool_calls]
                if m.role == "tool":
                    d["tool_call_id"] = m.tool_call_id
                out.append(d)
            return out, {}

        async def get_native_response(self, prompt: list[dict[str, Any]], model: str, sampling_args: Any, tools: Any = None, **kwargs: Any) -> dict[str, Any]:
            if self.turns is None:
                raise RuntimeError("this client scores rollouts only: it has no sampler")
            return await self.turns.respond(kwargs["state"]["input"]["paths_episode"], prompt, tools)

        async def raise_from_native_response(self, response: dict[str, Any]) -> None:
            return None  # an empty turn (EOS at once) is the model's answer, not an error

        async def from_native_response(self, r: dict[str, Any]) -> Any:
            calls = [ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]) for c in r["tool_calls"]] or None
            p, c = r["prompt_ids"], r["completion_ids"]
            return Response(id=f"paths-{time.monotonic_ns()}", created=int(time.time()), model="paths",
                            usage=Usage(prompt_tokens=len(p), reasoning_tokens=0, completion_tokens=len(c), total_tokens=len(p) + len(c)),
                            message=ResponseMessage(content=r["text"], tool_calls=calls, finish_reason=r["finish_reason"], is_truncated=r["finish_reason"] == "length",
                                                    tokens=ResponseTokens(prompt_ids=p, prompt_mask=[0] * len(p), completion_ids=c, completion_mask=[1] * len(c),
                                                                          completion_logprobs=r["logprobs"])))

        async def close(self) -> None:
            return None

    return _Client
