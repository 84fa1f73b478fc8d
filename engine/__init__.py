"""ExpertStream engine: run mlx-lm Mixture-of-Experts models with experts streamed from disk."""

import os
import sys

# mlx-lm loads tokenizers through transformers, which (5.x) warns on every start without
# PyTorch that "Models won't be available": true of transformers' own models and
# irrelevant here (MLX runs the model), yet it was the first line of every command's
# stderr. It is an advisory warning, and this turns off only those.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class BackendMissing(ImportError):
    """MLX's backend library cannot load: on Linux it is an extra (cpu or cuda) that
    was not installed."""


def _one_line(kind, error, tb, previous=sys.excepthook) -> None:
    """sys.excepthook while MLX cannot load: a BackendMissing that nothing caught (the
    import of `expertstream`, `expertstream-gui`, `--help` included) is its one line,
    the fix in it, not a traceback through the imports; anything else as before."""
    if issubclass(kind, BackendMissing):
        print(f"expertstream: error: {error}", file=sys.stderr)
    else:
        previous(kind, error, tb)


try:
    import mlx.core  # noqa: F401  (the backend library loads here)
except ImportError as e:
    sys.excepthook = _one_line
    raise BackendMissing(
        f"MLX cannot load ({e}). On Linux MLX's backend is an extra: install "
        "expertstream[cpu] (CPU) or expertstream[cuda] (NVIDIA GPU, CUDA 13), e.g. "
        "pip install -e '.[cpu,app]'"
    ) from None
