"""What every rank runs in tests/test_pipeline.py (started by mlx.launch, not by pytest).

`python pipeline_rank.py CASES.json OUT_DIR`: joins the group, then for each equality
case loads its store as this rank's stage and computes the greedy logits of
`test_equality.greedy_logits` (rank 0 saves tokens and logits to OUT_DIR/NAME.npz); for
each CLI case runs `expertstream` in-process and saves every rank's exit code, stdout and
stderr to OUT_DIR/NAME-RANK.json. One process runs every case: MLX and mlx-lm are
imported once per rank.
"""

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np

from engine import cli, pipeline
from engine.config import StreamConfig
from engine.model import load

from test_equality import greedy_logits


def main(cases_path: str, out_dir: str) -> None:
    cases = json.loads(Path(cases_path).read_text())
    out = Path(out_dir)
    group = pipeline.init_group()
    rank = group.rank()
    for case in cases["equality"]:
        config = StreamConfig(
            expert_slots=case["expert_slots"],
            side_slots=case["side_slots"],
            prefetch=case["side_slots"] > 0,
        )
        sm = load(case["store"], config, group=group)
        logits, tokens = greedy_logits(sm.model, case["prompt"], case["steps"])
        if rank == 0:
            np.savez(out / f"{case['name']}.npz", tokens=np.array(tokens), logits=np.stack(logits))
    for case in cases["cli"]:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = cli.main(case["argv"])
        result = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
        (out / f"{case['name']}-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
