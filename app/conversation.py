"""A conversation as plain data, and the prompt a model sees for it (no Qt).

Models with a chat template get the whole conversation through it; models without one
(the embedded TinyStories model) continue the concatenated text: a reply follows its
prompt exactly as generated; a user message follows the text so far, after a space when
neither side has one.
"""

from dataclasses import dataclass, field

USER, ASSISTANT = "user", "assistant"


@dataclass
class Conversation:
    """The turns so far, `(role, text)` with role USER or ASSISTANT."""

    turns: list[tuple[str, str]] = field(default_factory=list)

    def add(self, role: str, text: str) -> None:
        """Appends one turn."""
        if role not in (USER, ASSISTANT):
            raise ValueError(f"role {role!r} is neither {USER!r} nor {ASSISTANT!r}")
        self.turns.append((role, text))

    def clear(self) -> None:
        """Forgets every turn (New chat)."""
        self.turns.clear()

    def copy(self) -> "Conversation":
        """An independent copy (what is sent to the worker)."""
        return Conversation(list(self.turns))


def joiner(before: str, after: str) -> str:
    """What goes between two pieces of a plain continuation: a space when the text so far
    ends in a non-space and the new piece starts with one, else nothing."""
    if before and after and not before[-1].isspace() and not after[0].isspace():
        return " "
    return ""


def plain_text(conv: Conversation) -> str:
    """The conversation as one text to continue (models without a chat template)."""
    text = ""
    for role, piece in conv.turns:
        text += (joiner(text, piece) if role == USER else "") + piece
    return text


def prompt_ids(tokenizer, conv: Conversation) -> list[int]:
    """Token ids of the prompt for the next reply to `conv`.

    Through the tokenizer's chat template (generation prompt added) when it has one, else
    the encoded `plain_text`. For a single user turn this is what
    `engine.generate.prompt_tokens(sm, text, chat=True)` gives.

    Raises:
        ValueError: no tokenizer, or nothing to encode.
    """
    if tokenizer is None:
        raise ValueError("this model has no tokenizer files: the app needs one to chat")
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": role, "content": text} for role, text in conv.turns]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        ids = tokenizer.encode(plain_text(conv))
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    return list(ids)
