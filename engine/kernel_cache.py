"""MLX CUDA's kernel cache, as a user meets it: MLX compiles each CUDA kernel the first time
a process uses it (NVRTC) and keeps what it compiled on disk, so a machine's first reply
waits for the compiles and later processes read them instead (docs/benchmarks.md, "Decode
on a GPU")."""

import os
from pathlib import Path


def ptx_cache_dir() -> Path:
    """The kernel cache's directory, as MLX's `ptx_cache_dir()` picks it
    (mlx/backend/cuda/jit_module.cpp): `MLX_PTX_CACHE_DIR`, else `<temp>/mlx/<MLX
    version>/ptx`, `<temp>` as `std::filesystem::temp_directory_path` reads it on Linux
    and macOS (the first of TMPDIR, TMP, TEMP and TEMPDIR that is set, else /tmp)."""
    import mlx.core as mx

    if env := os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(env)
    temp = next(
        (v for k in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if (v := os.environ.get(k))), "/tmp"
    )
    return Path(temp) / "mlx" / mx.__version__ / "ptx"


def compile_note() -> str:
    """What a load says on MLX CUDA while the kernel cache (`ptx_cache_dir`) holds nothing:
    the first replies will wait for MLX's compiles. "" on other backends, once the cache
    holds kernels, or where it cannot be read. Taken before the load, which may compile a
    kernel itself."""
    from engine.memory_plan import cuda_pools

    if not cuda_pools():
        return ""
    try:
        cache = ptx_cache_dir()
        if cache.is_dir() and any(cache.iterdir()):
            return ""
    except OSError:  # not ours to read: MLX says what it cannot write itself
        return ""
    return (
        "MLX compiles its CUDA kernels as the first replies use them, which can take "
        f"minutes on a machine new to this MLX; it keeps them in {cache}"
    )
