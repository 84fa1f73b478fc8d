"""ExpertStream engine: run mlx-lm Mixture-of-Experts models with experts streamed from disk."""

import os

# mlx-lm loads tokenizers through transformers, which (5.x) warns on every start without
# PyTorch that "Models won't be available": true of transformers' own models and
# irrelevant here (MLX runs the model), yet it was the first line of every command's
# stderr. It is an advisory warning, and this turns off only those.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

try:
    import mlx.core  # noqa: F401  (the backend library loads here)
except ImportError as e:
    raise ImportError(
        f"MLX cannot load ({e}). On Linux MLX's backend is an extra: install "
        "expertstream[cpu] (CPU) or expertstream[cuda] (NVIDIA GPU, CUDA 13), e.g. "
        "pip install -e '.[cpu,app]'"
    ) from e
