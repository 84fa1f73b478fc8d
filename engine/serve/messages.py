"""Chat messages and function tools of a request as the chat template reads them: OpenAI's
message and tool shapes, which the other protocols' modules map theirs onto (an
assistant's `tool_calls` with parsed arguments, a tool result's `tool_call_id`)."""

import json

from engine.chat import ASSISTANT, ROLES, SYSTEM, TOOL
from engine.serve.bodies import RequestError, lone_surrogate, text, tool_choice


def openai_tools(data: dict) -> list[dict] | None:
    """The request's function tools, as chat templates read them; None without tools or
    with `tool_choice` "none" (the model is not told of them).

    Raises:
        RequestError: naming the field, for a malformed tool or a `tool_choice` that would
            force a call (replies are not constrained, so that cannot be promised).
    """
    tools = data.get("tools")
    if tool_choice(data.get("tool_choice")) == "none" or tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "tools must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError(f"{where}.type", f'{where} must be {{"type": "function", ...}}')
        out.append(function_tool(t.get("function"), f"{where}.function"))
    return out or None


def function_tool(f, where: str, schema_key: str = "parameters") -> dict:
    """`{"type": "function", "function": {"name", "description", "parameters"}}` of a
    function definition `f` whose schema is under `schema_key` (a null description or
    schema taken as absent: "" and an object of no properties).

    Raises:
        RequestError: naming the field under `where`.
    """
    if not isinstance(f, dict):
        raise RequestError(where, f"{where} must be an object with a name")
    name = text(f.get("name"), f"{where}.name", empty=False)
    # Null is absent, as for every optional field (`llm` sends a null description for a
    # function without a docstring).
    description = f.get("description")
    description = "" if description is None else text(description, f"{where}.description")
    schema = f.get(schema_key)
    if schema is None:
        schema = {"type": "object", "properties": {}}
    elif not isinstance(schema, dict):
        raise RequestError(f"{where}.{schema_key}", f"{where}.{schema_key} must be an object")
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


def call_arguments(value, where: str) -> dict:
    """A call's arguments (a JSON object, or its JSON text) as a dict.

    Raises:
        RequestError: naming `where`.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise RequestError(where, f"{where} is not JSON") from None
        # JSON text may spell a lone surrogate ("\ud800") as an escape, which the body's
        # check (read_json) does not see: the template renders it into a prompt that no
        # tokenizer encodes.
        if (inner := lone_surrogate(value, where)) is not None:
            raise RequestError(where, f"{inner} holds a lone UTF-16 surrogate: not text")
    if not isinstance(value, dict):
        raise RequestError(where, f"{where} must be a JSON object")
    return value


def content_text(content, where: str, part_types=("text",)) -> str:
    """A message's content: a string, or text parts (of `part_types`) joined.

    Raises:
        RequestError: naming `where` or the part.
    """
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in part_types):
                raise RequestError(f"{where}[{j}]", "only text content parts are supported")
            parts.append(text(part.get("text"), f"{where}[{j}].text"))
        return "".join(parts)
    return text(content, where)


def openai_messages(messages) -> list[dict]:
    """Chat messages as the chat template reads them: `{"role", "content": str}`, an
    assistant's `tool_calls` (arguments parsed), a tool result's `tool_call_id`.

    Raises:
        RequestError: naming the message field.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(where, f"{where} must be an object with role and content")
        role = SYSTEM if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role", f"{where}.role must be one of {ROLES}")
        content = m.get("content")
        message = {"role": role}
        if role == ASSISTANT and m.get("tool_calls") is not None:
            message["content"] = (
                "" if content is None else content_text(content, f"{where}.content")
            )
            message["tool_calls"] = openai_calls(m["tool_calls"], f"{where}.tool_calls")
        else:
            message["content"] = content_text(content, f"{where}.content")
        if role == TOOL:
            message["tool_call_id"] = text(m.get("tool_call_id"), f"{where}.tool_call_id", False)
        out.append(message)
    return out


def openai_calls(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, arguments parsed.

    Raises:
        RequestError: naming the field under `where`.
    """
    if not isinstance(calls, list):
        raise RequestError(where, f"{where} must be a list")
    out = []
    for j, c in enumerate(calls):
        here = f"{where}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict):
            raise RequestError(f"{here}.function", f"{here}.function must be an object")
        out.append(
            {
                "id": text(c.get("id", ""), f"{here}.id"),
                "type": "function",
                "function": {
                    "name": text(f.get("name"), f"{here}.function.name", empty=False),
                    "arguments": call_arguments(f.get("arguments"), f"{here}.function.arguments"),
                },
            }
        )
    return out
