"""MLX CUDA's kernel cache, as a user meets it: MLX compiles each CUDA kernel the first time
a process uses it (NVRTC, seconds to tens of seconds each) and keeps what it compiled on
disk, so a machine's first reply waits for them all and later processes do not."""

import os
import tempfile
from pathlib import Path


def ptx_cache_dir() -> Path:
    """Where MLX CUDA keeps the kernels it compiles: `MLX_PTX_CACHE_DIR`, else
    `<temp dir>/mlx/<MLX version>/ptx`, as MLX's `ptx_cache_dir()` picks it
    (mlx/backend/cuda/jit_module.cpp)."""
    import mlx.core as mx

    if env := os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(env)
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def compile_note() -> str:
    """What a load says on MLX CUDA while `ptx_cache_dir` holds nothing (the first
    replies then wait for MLX's compiles: docs/benchmarks.md, "Decode on a GPU"); "" on
    other backends, once the cache holds kernels, or where it cannot be read."""
    from engine.memory_plan import cuda_pools

    if not cuda_pools():
        return ""
    cache = ptx_cache_dir()
    try:
        if cache.is_dir() and any(cache.iterdir()):
            return ""
    except OSError:  # not ours to read: MLX says what it cannot write itself
        return ""
    return (
        "MLX compiles its CUDA kernels as the first replies use them, which can take "
        f"minutes on a machine new to this MLX; it keeps them in {cache}"
    )
