"""Chat through the model's template, the KV cache kept between turns, and
end-of-sequence ids merged from generation_config.json (as mlx-lm does)."""

import json
import shutil
from pathlib import Path

import pytest

from app.conversation import ASSISTANT, USER, Conversation, prompt_ids
from engine.cli import main
from engine.config import StreamConfig
from engine.generate import ChatSession, generate, prompt_tokens
from engine.model import load

from factories import CHAT_TEMPLATE, write_tokenizer


@pytest.fixture(scope="module")
def chat_model(qwen_store, tmp_path_factory):
    """The session's qwen3_moe store with a word-level tokenizer and a chat template."""
    store = Path(shutil.copytree(qwen_store.path, tmp_path_factory.mktemp("chat") / "store"))
    write_tokenizer(store, CHAT_TEMPLATE)
    return load(store, StreamConfig(expert_slots=4))


def decoded(sm, ids):
    return sm.tokenizer.decode(ids)


def test_generate_chat_uses_the_template_and_system_prompt(chat_model):
    ids = prompt_tokens(chat_model, "The cat sat", chat=True, system="on mat")
    assert decoded(chat_model, ids) == "SYSTEM on mat END USER The cat sat END ASSISTANT"
    plain = prompt_tokens(chat_model, "The cat sat", chat=False)
    assert decoded(chat_model, plain) == "The cat sat"


def test_app_conversation_formats_through_the_template(chat_model):
    conv = Conversation([(USER, "The cat"), (ASSISTANT, "sat"), (USER, "on mat")])
    ids = prompt_ids(chat_model.tokenizer, conv, system="The")
    assert decoded(chat_model, ids) == (
        "SYSTEM The END USER The cat END ASSISTANT sat END USER on mat END ASSISTANT"
    )
    # A stopped reply (empty or partial) still formats.
    conv.add(ASSISTANT, "")
    conv.add(USER, "mat")
    assert decoded(chat_model, prompt_ids(chat_model.tokenizer, conv)).endswith(
        "ASSISTANT END USER mat END ASSISTANT"
    )


def test_second_turn_prefills_only_the_new_turn(chat_model):
    sm = chat_model
    session = ChatSession(sm)
    conv = Conversation([(USER, "The cat sat on mat")])
    first = session.generate(prompt_ids(sm.tokenizer, conv), 8)
    assert first.cached_tokens == 0 and len(first.tokens) == 8
    conv.add(ASSISTANT, first.text)
    conv.add(USER, "The mat")
    ids = prompt_ids(sm.tokenizer, conv)
    second = session.generate(ids, 8)
    fresh = generate(sm, ids, 8)
    assert second.tokens == fresh.tokens
    # Kept: the first prompt and the reply's tokens the template gives back.
    assert second.cached_tokens >= len(prompt_ids(sm.tokenizer, Conversation(conv.turns[:1])))
    assert second.prompt_tokens + second.cached_tokens == len(ids)
    assert second.prompt_tokens < len(ids) // 2


def test_session_after_a_stopped_reply_starts_afresh(chat_model):
    sm = chat_model
    session = ChatSession(sm)
    ids = prompt_tokens(sm, "The cat sat", chat=True)
    stopped = session.generate(ids, 8, stop=lambda: True)  # cut inside the first forward
    assert stopped.stopped and stopped.tokens == []
    again = session.generate(ids, 6)
    assert again.cached_tokens == 0 and again.tokens == generate(sm, ids, 6).tokens
    # A different conversation shares no prefix beyond what matches: still exact.
    other = prompt_tokens(sm, "mat on", chat=False)
    assert session.generate(other, 5).tokens == generate(sm, other, 5).tokens


def test_chat_flag_on_a_model_without_template_says_so(capsys):
    code = main(["generate", "--chat", "--prompt", "Once upon a", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 0 and "has no chat template" in err


def test_eos_ids_of_generation_config_stop_the_reply(model_dirs, tmp_path):
    """mlx-lm merges generation_config.json's eos_token_id (here a list) over config.json's
    and stops on any of its ids: the reply ends at the first one."""
    model = Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "free"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"eos_token_id": 0}))
    write_tokenizer(model)
    prompt = [1, 2, 3]
    free = generate(load(model), prompt, 12)
    assert len(free.tokens) == 12 and 0 not in free.tokens[:3]
    third = free.tokens[2]
    assert third not in free.tokens[:2]

    model = Path(shutil.copytree(model, tmp_path / "eos"))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, third]}))
    stopped = generate(load(model), prompt, 12)
    assert stopped.tokens == free.tokens[:3] and stopped.finish_reason == "stop"
