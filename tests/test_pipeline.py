"""Pipeline-parallel streaming over mlx.distributed (engine.pipeline), on one machine.

`mlx.launch --backend ring -n 2` and `-n 3` on loopback run tests/pipeline_rank.py: each
rank loads only its stage; the greedy tokens and logits of rank 0 must be np.array_equal
to mlx-lm's resident model and to the single-process streamed model, at two expert budgets,
prefetch on and off, for families pipelined by mlx-lm's own pipeline(group) (qwen3_moe,
qwen3_next, deepseek_v3, glm4_moe) and by the split from outside (mixtral, qwen2_moe,
olmoe), with stages that hold no MoE layer. A stage whose blob files are missing stops
every rank with the reason; a killed rank ends the other with an error within seconds.
Every process has a timeout.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine import cli
from engine.config import StreamConfig
from engine.model import load
from engine.stage_store import copy_stage

from factories import make_family_model, write_tokenizer
from moe_families import FAMILIES
from test_equality import greedy_logits

pytestmark = pytest.mark.skipif(
    not mx.distributed.is_available(), reason="this MLX build has no distributed backend"
)

TESTS = Path(__file__).parent
LAUNCH = Path(sys.executable).with_name("mlx.launch")
PROMPT = [3, 17, 42, 5, 59, 60, 1, 8, 23, 37, 12, 50]  # ids below every vocabulary here
STEPS = 8
# (expert slots of 8 experts, side slots): evictions or every expert resident, prefetch
# off (0) or on; the second families of a launch run SHORT, to keep the file short.
FULL = ((3, 0), (3, 2), (8, 0), (8, 2))
SHORT = ((3, 2), (8, 0))
ONE = ((3, 2),)
# The families split from outside (engine.pipeline.GENERIC) beyond the factories' ones.
MORE_GENERIC = ("Klear", "bailing_moe", "deepseek", "dots1", "ernie4_5_moe", "granitemoe")
MORE_GENERIC += ("minimax", "phimoe")
LAUNCH_TIMEOUT_S = 300  # a bound for a loaded machine; ~20 s alone


def free_ports(n: int) -> int:
    """A base port with n consecutive ports free on 127.0.0.1 (the ring's listeners)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def launch(n: int, cases: dict, tmp: Path) -> Path:
    """Runs pipeline_rank.py on n ranks with mlx.launch (ring, loopback); returns the
    output folder."""
    out = tmp / f"out-{n}"
    out.mkdir()
    (tmp / f"cases-{n}.json").write_text(json.dumps(cases))
    cmd = [
        str(LAUNCH),
        "--backend",
        "ring",
        "-n",
        str(n),
        "--starting-port",
        str(free_ports(n)),
        "--python",
        sys.executable,
        str(TESTS / "pipeline_rank.py"),
        str(tmp / f"cases-{n}.json"),
        str(out),
    ]
    run = subprocess.Popen(
        cmd,
        cwd=TESTS,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the launcher and its ranks: one process group
    )
    try:
        stdout, stderr = run.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # ranks left by a timeout
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    # mlx.launch exits 0 even when a rank failed: its warnings say which.
    assert "[WARN]" not in stderr, stdout + stderr
    return out


def equality_cases(name: str, store: Path, configs=FULL) -> list[dict]:
    return [
        {
            "name": f"{name}-{slots}-{side}",
            "store": str(store),
            "expert_slots": slots,
            "side_slots": side,
            "prompt": PROMPT,
            "steps": STEPS,
        }
        for slots, side in configs
    ]


def check_equal(out: Path, name: str, model_dir: Path, store: Path, configs=FULL) -> None:
    """Rank 0's tokens and logits of every case of `name` equal mlx-lm resident's and the
    single-process streamed model's."""
    resident, _ = load_model(model_dir)
    ref_logits, ref_tokens = greedy_logits(resident, PROMPT, STEPS)
    for case in equality_cases(name, store, configs):
        got = np.load(out / f"{case['name']}.npz")
        config = StreamConfig(
            expert_slots=case["expert_slots"],
            side_slots=case["side_slots"],
            prefetch=case["side_slots"] > 0,
        )
        one_logits, one_tokens = greedy_logits(load(store, config).model, PROMPT, STEPS)
        assert got["tokens"].tolist() == ref_tokens == one_tokens, case["name"]
        for step, (a, b, c) in enumerate(zip(ref_logits, one_logits, got["logits"], strict=True)):
            assert np.array_equal(a, c) and np.array_equal(b, c), f"{case['name']} step {step}"


def cli_generate(model: str, *, pipeline: bool) -> list[str]:
    argv = ["generate", "--model", model, "--prompt", "The cat sat", "--max-tokens", "8"]
    return [*argv, "--expert-slots", "3", "--json", *(["--pipeline"] if pipeline else [])]


@pytest.fixture(scope="module")
def stores(model_dirs, tmp_path_factory):
    """(model dir, store) of each model used here: 4-layer models of factories (with a
    tokenizer), and 2- or 3-layer ones of moe_families (deepseek_v3 and glm4_moe: dense
    layer 0; qwen3_next: linear attention; MORE_GENERIC), quantized to 4 bits."""
    from engine.convert import convert

    made = {}
    for name, model_type, options in (
        ("qwen3", "qwen3_moe", {}),
        ("mixtral", "mixtral", {}),
        ("qwen3dense", "qwen3_moe", {"mlp_only_layers": (1,)}),
        ("qwen2", "qwen2_moe", {}),
        ("olmoe", "olmoe", {}),
    ):
        model_dir = model_dirs(model_type, **options)
        write_tokenizer(model_dir)
        made[name] = (model_dir, convert(model_dir, tmp_path_factory.mktemp("st") / name))
    for name in ("deepseek_v3", "glm4_moe", "qwen3_next", *MORE_GENERIC):
        q4 = {"group_size": 32, "bits": 4}
        model_dir = make_family_model(
            tmp_path_factory.mktemp(name), FAMILIES[name], quantization=q4
        )
        made[name] = (model_dir, convert(model_dir, tmp_path_factory.mktemp("st") / name))
    return made


def test_two_ranks_equal_resident_and_single_process(stores, tmp_path, capsys):
    """2 ranks: qwen3_moe and qwen3_next (mlx-lm's pipeline), mixtral and the other
    families split from outside; the CLI with a store per rank (copy-stage) and with a
    stage whose blobs are missing."""
    qwen_dir, qwen = stores["qwen3"]
    mixtral_dir, mixtral = stores["mixtral"]
    for rank in (0, 1):
        copy_stage(mixtral, tmp_path / f"mixtral-stage{rank}", rank, 2)
    cases = {
        "equality": equality_cases("qwen3", qwen)
        + equality_cases("mixtral", mixtral)
        + equality_cases("qwen3_next", stores["qwen3_next"][1], SHORT)
        + [c for n in MORE_GENERIC for c in equality_cases(n, stores[n][1], ONE)],
        "cli": [
            {
                "name": "stages",
                "argv": cli_generate(str(tmp_path / "mixtral-stage{rank}"), pipeline=True),
            },
            {
                "name": "missing",
                "argv": cli_generate(str(tmp_path / "mixtral-stage0"), pipeline=True),
            },
        ],
    }
    out = launch(2, cases, tmp_path)
    check_equal(out, "qwen3", qwen_dir, qwen)
    check_equal(out, "qwen3_next", *stores["qwen3_next"], SHORT)
    for name in MORE_GENERIC:
        check_equal(out, name, *stores[name], ONE)
    check_equal(out, "mixtral", mixtral_dir, mixtral)

    assert cli.main(cli_generate(str(mixtral), pipeline=False)) == 0
    single = json.loads(capsys.readouterr().out)
    ranks = [json.loads((out / f"stages-{r}.json").read_text()) for r in (0, 1)]
    assert [r["code"] for r in ranks] == [0, 0], ranks
    assert ranks[1]["stdout"] == ""  # rank 0 alone prints
    got = json.loads(ranks[0]["stdout"])
    assert got["tokens"] == single["tokens"]
    per_rank = got["stats"]["ranks"]
    assert [r["layers"] for r in per_rank] == [[2, 4], [0, 2]]
    assert got["stats"]["bytes_read"] == sum(r["bytes_read"] for r in per_rank) > 0
    assert all(r["bytes_read"] > 0 for r in per_rank)

    missing = [json.loads((out / f"missing-{r}.json").read_text()) for r in (0, 1)]
    for r in missing:  # every rank stops, naming the rank and the files
        assert r["code"] == 2
        assert (
            "rank 1: " + str(tmp_path / "mixtral-stage0") + ": missing blob files layer00.blob, "
            "layer01.blob (this stage runs decoder layers 0-1)"
        ) in r["stderr"]


def test_three_ranks_equal_resident_and_single_process(stores, tmp_path):
    """3 ranks: stages without MoE layers (qwen3_moe with its dense layer 1 alone on rank
    1; deepseek_v3 and glm4_moe, one layer per rank, dense layer 0 on rank 2), and the
    other families split from outside."""
    configs = {"qwen3dense": FULL} | dict.fromkeys(
        ("qwen2", "olmoe", "deepseek_v3", "glm4_moe"), SHORT
    )
    cases = [c for n, cf in configs.items() for c in equality_cases(n, stores[n][1], cf)]
    out = launch(3, {"equality": cases, "cli": []}, tmp_path)
    for name, cf in configs.items():
        check_equal(out, name, *stores[name], cf)


def start_two_ranks(store, tmp_path, *argv: str) -> list[subprocess.Popen]:
    """`expertstream generate --pipeline --model store *argv` as ranks 0 and 1, started as
    mlx.launch starts them (MLX_RANK, a ring hostfile on two free loopback ports)."""
    base = free_ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    return [
        subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "generate", "--pipeline", "--model", str(store)]
            + list(argv),
            env=os.environ | {"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]


def test_killed_rank_ends_the_other_with_an_error(stores, tmp_path):
    """Two ranks started as mlx.launch starts them; rank 1 is killed mid-reply: rank 0
    stops with an error within seconds (not a hang)."""
    _, store = stores["qwen3"]
    procs = start_two_ranks(store, tmp_path, "--max-tokens", "480")
    try:
        procs[0].stdout.read(len("Once upon a time") + 1)  # the prompt, then a token
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=30)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 2, err
    assert "expertstream generate: error: rank 0: the pipeline stopped" in err
    assert waited < 20


def test_every_rank_refuses_slots_below_top_k(stores, tmp_path):
    """The one rule of `expertstream generate` (engine.memory_plan.check_real_slots) holds
    with --pipeline: every rank refuses, in one line."""
    _, store = stores["qwen3"]
    procs = start_two_ranks(store, tmp_path, "--expert-slots", "1")
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2 and out == "", (out, err)
        assert err == (
            "expertstream generate: error: --expert-slots 1: must be >= 2, the experts each "
            "token is routed to per MoE layer (top-k)\n"
        ), err
