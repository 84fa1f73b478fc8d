"""Loading the tokenizer of a store (or of a store being written) with mlx-lm, as
generation will, so that a broken tokenizer is refused by name: at load, and by convert
before any weight is written. Code in the files is never run (`trust_remote_code=False`:
an `auto_map` is refused).
"""

from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_tokenizer

from engine.safe_io import ModelFileError
from engine.validate import brief, is_token_ids, show

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def load_dir_tokenizer(
    path: Path, where: Path | None = None, error: type[Exception] = ModelFileError
) -> TokenizerWrapper | None:
    """mlx-lm's tokenizer of the directory `path`, or None when it has no tokenizer files
    (`TOKENIZER_FILES`). Its end-of-sequence ids are mlx-lm's: `eos_token_id` (an int or a
    list) of generation_config.json when it has one, else of config.json, plus the
    tokenizer's own.

    Args:
        path: a directory holding only regular files of a model (a store, or the
            temporary directory of one being written).
        where: the directory named in messages (default `path`).

    Raises:
        error: one line naming `where` (and the file at fault where known): the files
            cannot be loaded, `eos_token_id` is not a token id or a list of them, the
            tokenizer holds no vocabulary, or its ids run past the model's (`vocab_size`
            of config.json: generation would fail on the first such id).
    """
    where = path if where is None else where
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        config = load_config(path)  # generation_config.json merged in
    except Exception as e:  # a JSONDecodeError, or a file that is not an object
        raise error(
            f"{where}: cannot read config.json / generation_config.json ({brief(e)})"
        ) from None
    eos = config.get("eos_token_id")
    if not is_token_ids(eos):
        raise error(
            f"{where / 'generation_config.json'}: eos_token_id is {show(eos)}, expected a "
            "token id, a list of token ids, or null"
        )
    try:
        tokenizer = load_tokenizer(path, {"trust_remote_code": False}, eos_token_ids=eos)
        empty = not tokenizer.encode("The", add_special_tokens=False)
    except Exception as e:  # transformers and tokenizers raise many kinds
        raise error(f"{where}: cannot load the tokenizer ({brief(e)})") from None
    if empty:
        raise error(
            f"{where}: the tokenizer has no vocabulary (tokenizer_config.json without "
            "tokenizer.json or its vocabulary files?)"
        )
    vocab_size = config.get("vocab_size")
    if type(vocab_size) is int and vocab_size > 0:  # config.json's own check names others
        top = max(tokenizer.get_vocab().values(), default=-1)
        if top >= vocab_size:
            files = "tokenizer.json" if (path / "tokenizer.json").exists() else "tokenizer files"
            raise error(
                f"{where / files}: token ids run to {top}, past the model's vocabulary of "
                f"{vocab_size} (vocab_size in config.json): this tokenizer is not the "
                "model's"
            )
    return tokenizer
