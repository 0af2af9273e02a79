"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a reply's `<think>…</think>` part becomes
`reasoning_content`, the rest `content`.

- `qwen3`: the model writes `<think>` itself (or skips thinking: `enable_thinking=False` templates write an
  empty think block, and a reply without `</think>` is all content).
- `deepseek-r1`: the chat template opens `<think>` in the prompt, so the reply starts inside the reasoning:
  everything before `</think>` is reasoning, all of it when `</think>` never comes.
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek-r1")
PARSER_ALIASES = {"deepseek_r1": "deepseek-r1"}  # (vLLM's name; `--reasoning-parser` takes it too)
START, END = "<think>", "</think>"


def split_reasoning(parser: str, text: str, final: bool = True) -> tuple[str, str]:
    """(reasoning, content) of the reply `text` (or of the part of it received so far when not `final`:
    then a tail that may be the start of `</think>` belongs to neither yet)."""
    at = text.find(END)
    if at >= 0:
        return text[:at].lstrip().removeprefix(START), text[at + len(END) :].lstrip("\n")
    head = text.lstrip()
    if not final and START.startswith(head):  # nothing yet, or `<think>` arriving
        return "", ""
    if parser != "deepseek-r1" and not head.startswith(START):
        return "", text
    reasoning = head.removeprefix(START)
    if not final:
        for k in range(min(len(END) - 1, len(reasoning)), 0, -1):
            if END.startswith(reasoning[-k:]):
                return reasoning[:-k], ""
    return reasoning, ""
