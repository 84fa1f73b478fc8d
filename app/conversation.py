"""A conversation as plain data (no Qt); `engine.chat` turns it into the model's prompt:
through the chat template when the tokenizer has one, else as one continued text."""

from dataclasses import dataclass, field

from engine.chat import ASSISTANT, SYSTEM, USER, chat_ids

__all__ = ["ASSISTANT", "USER", "Conversation", "prompt_ids"]


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

    def messages(self, system: str = "") -> list[dict]:
        """The turns as chat messages, after a system message when `system` is not empty."""
        first = [{"role": SYSTEM, "content": system}] if system else []
        return first + [{"role": role, "content": text} for role, text in self.turns]


def prompt_ids(tokenizer, conv: Conversation, system: str = "") -> list[int]:
    """Token ids of the prompt for the next reply to `conv` (`engine.chat.chat_ids`; the
    `system` prompt is used by chat templates only). For a single user turn this is what
    `engine.generate.prompt_tokens(sm, text, chat=True, system=system)` gives.

    Raises:
        ValueError: no tokenizer, nothing to encode, or the template refuses the turns.
    """
    return chat_ids(tokenizer, conv.messages(system))
