"""Stage stores: what one pipeline stage's host needs of an expert store.

A host that runs one stage (engine.pipeline) opens only that stage's blob files (and
loads only its layers' dense weights). `copy_stage` writes such a store from a whole one:
the same manifest (every layer listed, with its checksums), config, tokenizer files and
`dense.safetensors` (whole: it is checksummed as one file and checked against the config;
the experts are the bulk of a MoE model), and only the stage's blob files. Copy it to the
host (rsync, scp) and pass its path to `expertstream generate --pipeline --model`.
"""

import shutil
from pathlib import Path

from engine.convert import aux_files
from engine.pipeline import Stage, stage_of
from engine.safe_io import fsync_path
from engine.store import CONFIG_FILE, DENSE_FILE, ExpertStore
from engine.store_writer import StoreWriter


def copy_stage(
    store_dir: str | Path, dest: str | Path, rank: int, size: int, force: bool = False
) -> tuple[Path, Stage]:
    """Writes the store of pipeline stage `rank` of `size` of the store `store_dir` to
    `dest` (atomically: complete or absent).

    Returns:
        (`dest`, the stage written).

    Raises:
        StoreError: `store_dir` is not a valid store, or lacks a blob of the stage.
        ValueError: more ranks than decoder layers, or `store_dir` is an in-place store
            (its experts are the model directory's files).
        FileExistsError: `dest` exists and not `force`.
        OSError: a read or write failed.
    """
    src = ExpertStore(store_dir, blob_layers=range(0))
    if src.in_place:
        raise ValueError(
            f"{src.path} is an in-place store: it reads the experts from {src.model_dir}; "
            "copy that model directory to each host (or `expertstream convert` it into a "
            "blob store and copy-stage that)"
        )
    stage = stage_of(src.config, rank, size, src.path / CONFIG_FILE)
    src = ExpertStore(store_dir, blob_layers=stage.layers)  # says which blobs are missing
    m = src.manifest
    with StoreWriter(dest, m.num_experts) as writer:
        writer.layers = list(m.layers)
        writer.copy_dense(src.path / DENSE_FILE)
        for spec in m.layers:
            if stage.holds(spec.layer):
                shutil.copyfile(src.blob_path(spec), writer.path / spec.file)
                fsync_path(writer.path / spec.file)
        for entry in aux_files(src.path):
            if not entry.name.startswith("autopin"):  # pin sets belong to the source's run
                shutil.copyfile(entry, writer.path / entry.name)
                fsync_path(writer.path / entry.name)
        return writer.finish(m.model_type, m.top_k, m.num_hidden_layers, force), stage
