"""A tiny MoE model that calls a tool: a real qwen3_moe model (random, as factories.py
builds them) whose embedding and output weights make greedy decoding follow a fixed next
token for each token, and a chat template in the format mlx-lm's `json_tools` parser
reads (Qwen's `<tool_call>` JSON `</tool_call>`).

After the template's generation prompt "ASSISTANT" the model writes
`<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>`, then
ends; after a tool's result (the prompt ends "ANSWER") it writes "The cat sat on mat".
"""

import json
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer, models, pre_tokenizers

from factories import _rewrite_weights, make_random_model

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_TEXT = f"<tool_call> {json.dumps(CALL)} </tool_call>"
ANSWER = "The cat sat on mat"
# The tool the model calls, as OpenAI's chat completions and Ollama's chat declare it.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": CALL["name"],
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

WORDS = [
    "[UNK]",
    "<eos>",
    "<tool_call>",
    json.dumps(CALL),
    "</tool_call>",
    "The",
    "cat",
    "sat",
    "on",
    "mat",
    "SYSTEM",
    "USER",
    "ASSISTANT",
    "TOOL",
    "TOOLS",
    "ANSWER",
    "END",
    "sunny",
    "weather",
    "get_weather",
    "<think>",
    "</think>",
]
VOCAB = 32  # WORDS, then unused ids

# Each word's next word under greedy decoding; any other token is followed by <eos>.
NEXT = {
    "ASSISTANT": "<tool_call>",
    "<tool_call>": json.dumps(CALL),
    json.dumps(CALL): "</tool_call>",
    "ANSWER": "The",
    "The": "cat",
    "cat": "sat",
    "sat": "on",
    "on": "mat",
}

# Renders tools, the assistant's calls and the tools' results; "tool_call.name" and
# "<tool_call>" are what mlx-lm's template inference picks the json_tools parser by.
TEMPLATE = (
    "{% if tools %}SYSTEM TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}END "
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}TOOL {{ m.content }} END "
    "{% elif m.tool_calls %}ASSISTANT {% for c in m.tool_calls %}{% set tool_call = c.function %}"
    "<tool_call> {{ {'name': tool_call.name, 'arguments': tool_call.arguments} | tojson }} "
    "</tool_call> {% endfor %}END "
    "{% else %}{{ m.role | upper }} {{ m.content }} END {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if messages[-1].role == 'tool' %}ANSWER{% else %}ASSISTANT{% endif %}{% endif %}"
)


def make_tool_model(out_dir: str | Path) -> Path:
    """Writes the model directory (float32 weights, tokenizer, chat template) to `out_dir`
    and returns it."""
    out_dir = Path(out_dir)
    make_random_model(out_dir, "qwen3_moe", quantized=False, vocab=VOCAB, hidden=64)
    ids = {w: i for i, w in enumerate(WORDS)}
    hidden = 64
    # Token i's embedding is 4 * e_i: it outweighs what the random layers add to the
    # residual, so the final norm leaves about 8 * e_i, and the output row of i's next
    # word picks it out.
    embed = mx.zeros((VOCAB, hidden)).at[mx.arange(VOCAB), mx.arange(VOCAB)].add(4.0)
    head = [[0.0] * hidden for _ in range(VOCAB)]
    for i in range(VOCAB):
        j = ids[NEXT.get(WORDS[i], "<eos>")] if i < len(WORDS) else ids["<eos>"]
        head[j][i] = 4.0
    weights = dict(mx.load(str(out_dir / "model.safetensors")))
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = mx.array(head)
    _rewrite_weights(out_dir, weights)

    config = json.loads((out_dir / "config.json").read_text())
    config["eos_token_id"] = ids["<eos>"]
    (out_dir / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel(ids, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>",
        "chat_template": TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out_dir
