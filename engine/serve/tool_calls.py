"""A reply's text split into what the model said and the tool calls it wrote.

The markers and the parser are mlx-lm's (the tokenizer's `tool_call_start`, `tool_call_end`
and `tool_parser`, picked from the chat template as mlx_lm.server picks them), and so is
the text state machine that finds them in text that arrives piece by piece
(`mlx_lm.generate.make_text_state_machine`): markers are found in the decoded text, so a
marker split across tokens or pieces is still one marker.
"""

import json
import uuid
from dataclasses import dataclass

from mlx_lm.generate import TextStateMachine, make_text_state_machine


@dataclass
class ToolCall:
    """One call the model wrote.

    Attributes:
        id: a fresh id ("call_" + hex), or the one the parser found.
        name: the function's name.
        arguments: the call's arguments (a JSON object, parsed).
    """

    id: str
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        """The arguments as the JSON text OpenAI's `function.arguments` carries."""
        return json.dumps(self.arguments, ensure_ascii=False)


class ToolCallStream:
    """Splits a reply's text, fed in pieces, into text and `ToolCall`s.

    Args:
        tokenizer: mlx-lm's TokenizerWrapper with `has_tool_calling`.
        tools: the request's tools (the parser may read their parameter types).

    `feed` and `end` return items in reply order: `str` (text the model said outside any
    call, its reasoning markers included, as it wrote them) or `ToolCall`. A call that
    cannot be parsed (cut by max_tokens, or not what the parser reads) is given back as
    the text the model wrote, markers included, so nothing the model said is lost.
    """

    def __init__(self, tokenizer, tools: list[dict]):
        self._parse = tokenizer.tool_parser
        self._start, self._end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
        # The state machine consumes the reasoning markers too: they are given back.
        self._think = (
            (tokenizer.think_start, tokenizer.think_end) if tokenizer.has_thinking else None
        )
        self._tools = tools
        self._state = make_text_state_machine(tokenizer).make_state("normal")
        self._state_name = "normal"  # the state the last segment was in
        self._call = ""  # the text of the call being written
        self.calls = 0

    def feed(self, piece: str) -> list:
        """Items of the text `piece` adds (text that may begin a marker is held back)."""
        self._state, segments = TextStateMachine.split(self._state, piece)
        return self._items(segments)

    def end(self) -> list:
        """Items left at the end of the reply: held-back text, an unfinished call."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        items = self._items([(state, rest)])
        if state == "tool":
            items += self._close(finished=False)
        return items

    def _items(self, segments: list[tuple[str | None, str]]) -> list:
        items = []
        previous = self._state_name
        for state, text in segments:
            if previous == "tool" and state != "tool":
                items += self._close(finished=True)
            if self._think and (previous, state) == ("normal", "reasoning"):
                items.append(self._think[0])
            if self._think and (previous, state) == ("reasoning", "normal"):
                items.append(self._think[1])
            if state == "tool":
                self._call += text
            elif text:
                items.append(text)
            previous = state
        self._state_name = previous
        return items

    def _close(self, finished: bool) -> list:
        text, self._call = self._call, ""
        try:
            parsed = self._parse(text, self._tools) if finished else None
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            parsed = None
        calls = parsed if isinstance(parsed, list) else [parsed]
        out = []
        for c in calls:
            if not (isinstance(c, dict) and isinstance(c.get("name"), str)):
                return [self._start + text + (self._end if finished else "")]
            arguments = c.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return [self._start + text + (self._end if finished else "")]
            if not isinstance(arguments, dict) or not _utf8(c["name"], arguments):
                return [self._start + text + (self._end if finished else "")]
            out.append(ToolCall(c.get("id") or f"call_{uuid.uuid4().hex}", c["name"], arguments))
        self.calls += len(out)
        return out


def _utf8(*values) -> bool:
    """`values` (parsed JSON) can be written as UTF-8: JSON text can escape a lone UTF-16
    surrogate ("\\ud800"), which parses to a string no reply can carry."""
    try:
        json.dumps(values, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
