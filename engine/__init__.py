"""ExpertStream engine: run mlx-lm Mixture-of-Experts models with experts streamed from disk."""
