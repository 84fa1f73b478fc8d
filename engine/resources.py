"""Where the shipped resources are: inside the installed package, or the source tree."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent
DEFAULT_MODEL_NAME = "tinystories-moe"


def resources_dir() -> Path:
    """`engine/resources` in an installed wheel, else `resources/` of the source tree."""
    installed = _HERE / "resources"
    return installed if installed.is_dir() else _HERE.parent / "resources"


def default_model_path() -> Path:
    """The embedded default model: an mlx-lm Qwen3-MoE directory (see its README)."""
    return resources_dir() / "models" / DEFAULT_MODEL_NAME
