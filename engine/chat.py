"""A conversation as the token ids a model sees (no MLX here: the app's GUI thread and the
server's request handlers use it).

Models whose tokenizer has a chat template get the whole conversation through it, with a
system prompt first when one is given. Models without one (the embedded TinyStories
model) continue the concatenated text: a reply follows its prompt exactly as generated; a
user message follows the text so far, after a space when neither side has one; system
messages have no place in a plain continuation and are left out; a tool's result is text
the user side gives, as a user message is.

Tools (function definitions, as OpenAI's `tools` field holds them) go through the chat
template too, with the assistant's tool calls and the tools' results in the history: the
template decides how the model sees them, and mlx-lm's tokenizer knows how the model
writes a call (`has_tool_calling`, its `tool_parser`).
"""

from collections.abc import Sequence
from pathlib import Path

from engine.template_bounds import render_bounded
from engine.validate import brief

USER, ASSISTANT, SYSTEM, TOOL = "user", "assistant", "system", "tool"
ROLES = (SYSTEM, USER, ASSISTANT, TOOL)


def has_chat_template(tokenizer) -> bool:
    """True when `tokenizer` (mlx-lm TokenizerWrapper or None) has a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def has_tool_calling(tokenizer) -> bool:
    """True when `tokenizer`'s chat template renders tools and mlx-lm knows how the model
    writes a call (a tool parser of `mlx_lm.tool_parsers`, chosen as mlx-lm chooses it)."""
    return has_chat_template(tokenizer) and bool(getattr(tokenizer, "has_tool_calling", False))


def joiner(before: str, after: str) -> str:
    """What goes between two pieces of a plain continuation: a space when the text so far
    ends in a non-space and the new piece starts with one, else nothing."""
    if before and after and not before[-1].isspace() and not after[0].isspace():
        return " "
    return ""


def plain_text(messages: Sequence[dict]) -> str:
    """The conversation as one text to continue (models without a chat template).

    Args:
        messages: `{"role": ..., "content": str}` dicts; system messages are skipped,
            tool results read as user messages.
    """
    text = ""
    for m in messages:
        if m["role"] == SYSTEM:
            continue
        piece = m["content"]
        text += (joiner(text, piece) if m["role"] in (USER, TOOL) else "") + piece
    return text


def chat_ids(
    tokenizer,
    messages: Sequence[dict],
    vocab_size: int | None = None,
    tools: Sequence[dict] | None = None,
) -> list[int]:
    """Token ids of the prompt for the next assistant reply to `messages`.

    Through the tokenizer's chat template (generation prompt added) when it has one, else
    the encoded `plain_text`.

    Args:
        messages: `{"role": "system" | "user" | "assistant" | "tool", "content": str}`
            dicts; an assistant message may add `tool_calls` (`[{"id", "type":
            "function", "function": {"name", "arguments": dict}}]`), a tool message its
            `tool_call_id` and `name`, as Hugging Face chat templates read them.
        vocab_size: the model's vocabulary (config.json), checked when given.
        tools: OpenAI function definitions (`{"type": "function", "function": {"name",
            "description", "parameters"}}`) for the template; only with
            `has_tool_calling(tokenizer)`.

    Raises:
        ValueError: no tokenizer, a role outside `ROLES`, tools for a model that cannot
            call them, the template refuses the conversation (its own message, or a size
            or time bound of `engine.template_bounds`), nothing to encode, or an id
            outside the vocabulary.
    """
    if tokenizer is None:
        raise ValueError("this model has no tokenizer files: chat needs one")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role {m.get('role')!r} is not one of {ROLES}")
    if tools and not has_tool_calling(tokenizer):
        raise ValueError(
            f"{template_source(tokenizer)}: this model's chat template does not render tools "
            "in a format mlx-lm can parse calls from (no tool parser of mlx_lm.tool_parsers "
            "matches it)"
        )
    if has_chat_template(tokenizer):
        extra = {"tools": list(tools)} if tools else {}
        try:
            ids = render_bounded(
                lambda: tokenizer.apply_chat_template(
                    list(messages), add_generation_prompt=True, **extra
                )
            )
        except Exception as e:  # jinja2's TemplateError, raise_exception, the bounds' errors
            raise ValueError(
                f"{template_source(tokenizer)}: the chat template refuses the conversation "
                f"({brief(e)})"
            ) from e
    else:
        ids = encode(tokenizer, plain_text(messages))
    return checked_ids(ids, vocab_size)


def template_source(tokenizer) -> str:
    """The file the tokenizer's chat template came from (for messages): the model
    directory's `chat_template.jinja` when it has one, else its `tokenizer_config.json`."""
    root = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
    jinja = root / "chat_template.jinja"
    return str(jinja if jinja.is_file() else root / "tokenizer_config.json")


def encode(tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text)` without transformers' warning about a text longer than
    the tokenizer's maximum length (the context check reports that, naming both sizes)."""
    return tokenizer.encode(text, verbose=False)


def checked_ids(ids: Sequence[int], vocab_size: int | None) -> list[int]:
    """`ids` as a list, refused when empty or outside the vocabulary.

    Raises:
        ValueError: no ids, or an id >= `vocab_size` (tokenizer and model do not match).
    """
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    if vocab_size and max(ids) >= vocab_size:
        raise ValueError(
            f"the tokenizer produced token id {max(ids)}, outside the model's vocabulary of "
            f"{vocab_size} (vocab_size in config.json): tokenizer and model do not match"
        )
    return list(ids)
