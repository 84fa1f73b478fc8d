"""ExpertStream engine: run mlx-lm Mixture-of-Experts models with experts streamed from disk."""

try:
    import mlx.core  # noqa: F401  (the backend library loads here)
except ImportError as e:
    raise ImportError(
        f"MLX cannot load ({e}). On Linux MLX's backend is an extra: install "
        "expertstream[cpu] (CPU) or expertstream[cuda] (NVIDIA GPU, CUDA 13), e.g. "
        "pip install -e '.[cpu,app]'"
    ) from e
