"""A conversation's prompt: the messages rendered with the tokenizer's chat template, then tokenized.

The template writes the special tokens itself (BOS, role markers), so its text is encoded without the
tokenizer adding any more. A tokenizer without a template is refused by name: a plain-text fallback
would give a chat model a prompt it was never trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]  # {"role": ..., "content": ...}, as OpenAI and transformers take them


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template (and none was given), so chat messages cannot be rendered."""


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of `messages`. `add_generation_prompt` opens the assistant's turn; `chat_template`
    replaces the tokenizer's own; `chat_template_kwargs` go to the template (e.g. Qwen3's
    `enable_thinking`). Raises NoChatTemplate when there is no template to render with."""
    if chat_template is None and not has_chat_template(tokenizer):
        raise NoChatTemplate(
            "the model's tokenizer has no chat template, so it cannot render chat messages: prompt it with "
            "plain text (LLM.generate, /v1/completions) or pass a chat_template"
        )
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tokenize=False,
        **dict(chat_template_kwargs or {}),
    )


class RenderedChat(NamedTuple):
    """A conversation through the chat template: the prompt text and its token ids."""

    text: str
    ids: list[int]


def render_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], **options: Any
) -> RenderedChat:
    """`chat_text` (same options) and its token ids: encoded without added special tokens, since the
    template writes its own."""
    text = chat_text(tokenizer, messages, **options)
    return RenderedChat(text, tokenizer.encode(text, add_special_tokens=False))
