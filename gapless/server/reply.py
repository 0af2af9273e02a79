"""A chat reply's text split the way the request asked: `reasoning_content` (`--reasoning-parser`),
`content`, and `tool_calls` (`gapless.server.tools`), whole or as it streams."""

from __future__ import annotations

from dataclasses import dataclass

from gapless.server.reasoning import split_reasoning
from gapless.server.tools import ToolCall, ToolPlan


@dataclass(frozen=True)
class ChatReply:
    tools: ToolPlan | None = None
    reasoning: str | None = None  # the reasoning parser's name

    @property
    def plain(self) -> bool:
        """Text only: the reply is its content, delta by delta."""
        return self.reasoning is None and (self.tools is None or self.tools.mode == "none")

    def final(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """The finished reply `text` as (reasoning or None, content, tool calls)."""
        reasoning, content = split_reasoning(self.reasoning, text) if self.reasoning else (None, text)
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.calls(content)
        return reasoning, content, calls

    def streamable(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of the reply received so far that may be streamed now: prefixes of what
        `final` will give."""
        reasoning, content = (
            split_reasoning(self.reasoning, text, final=False) if self.reasoning else ("", text)
        )
        if self.tools is not None:
            content = self.tools.streamed_prefix(content)
        return reasoning, content
