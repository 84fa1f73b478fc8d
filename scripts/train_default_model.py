#!/usr/bin/env python3
"""Train ExpertStream's embedded default model: a tiny Qwen3-MoE trained on TinyStories.

Pipeline (CPU only, no network):

1. Read the corpus, repair the known UTF-8 mojibake (``â€œ`` -> ``"`` etc.), split it into stories
   (a single newline separates stories, blank lines separate paragraphs) and hold out the last ~2%
   of the stories as the validation set.
2. Train a byte-level BPE tokenizer (``tokenizers``) on the training stories, with ``<|endoftext|>``
   as bos/eos/pad, and wrap it as a Hugging Face fast tokenizer.
3. Build a small ``Qwen3MoeForCausalLM`` in PyTorch (every layer MoE, router auxiliary
   load-balancing loss on) and train it with AdamW + linear warmup + cosine decay on random
   windows of the token stream. Prints train loss periodically, evaluates the held-out loss every
   ``--eval-every`` steps and keeps the weights with the best validation loss.
4. Save the HF checkpoint (model + tokenizer) to a temporary directory and convert it with
   ``python -m mlx_lm convert -q --q-bits 4 --q-group-size 64 --dtype float32`` (the way
   mlx-community checkpoints are made), then put the result in ``--out`` together with a README.md
   describing the run. Finally the converted model is loaded with ``mlx_lm`` to measure the 4-bit
   validation loss and produce a greedy sample.

Example (from the repository root)::

    /work/venv-train/bin/python scripts/train_default_model.py --steps 600
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = REPO_ROOT / ".." / "shared" / "data" / "corpora" / "tinystories_sample_944k.txt"
DEFAULT_OUT = REPO_ROOT / "resources" / "models" / "tinystories-moe"
EOT = "<|endoftext|>"

# Mojibake present in the TinyStories sample (UTF-8 read as cp1252, with the 0x9d byte lost).
# Longest sequences first; the bare "â€" left over is a closing double quote.
MOJIBAKE = [
    ("â€œ", '"'),
    ("â€™", "'"),
    ("â€˜", "'"),
    ("â€“", "-"),
    ("â€”", "-"),
    ("â€¦", "..."),
    ("â€\x9d", '"'),
    ("â€", '"'),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--corpus",
        type=Path,
        default=DEFAULT_CORPUS,
        help="training text (default: ../shared/data/corpora/tinystories_sample_944k.txt "
        "relative to the repo root)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="output directory for the MLX model (default: resources/models/tinystories-moe)",
    )
    p.add_argument(
        "--hf-out",
        type=Path,
        default=None,
        help="also keep the float32 Hugging Face checkpoint here (default: temp dir, deleted)",
    )
    # data / tokenizer
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument(
        "--val-fraction", type=float, default=0.02, help="fraction of the corpus (tail) held out"
    )
    p.add_argument("--seq-len", type=int, default=256)
    # architecture
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--experts-per-tok", type=int, default=4)
    p.add_argument(
        "--moe-intermediate-size",
        type=int,
        default=128,
        help="must be a multiple of 64 so the expert down_proj is quantizable with group 64",
    )
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--router-aux-loss-coef", type=float, default=0.01)
    p.add_argument(
        "--untie-embeddings", action="store_true", help="separate lm_head (default: tied)"
    )
    # optimisation
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument(
        "--min-lr-ratio", type=float, default=0.1, help="final lr = lr * ratio (cosine floor)"
    )
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument(
        "--no-keep-best",
        action="store_true",
        help="export the final weights instead of the best-validation weights",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    # conversion
    p.add_argument("--q-bits", type=int, default=4)
    p.add_argument("--q-group-size", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--sample-prompt", default="Once upon a time")
    p.add_argument("--sample-tokens", type=int, default=60)
    return p.parse_args()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_stories(path: Path) -> tuple[list[str], int]:
    text = path.read_text(encoding="utf-8")
    n_fixed = 0
    for bad, good in MOJIBAKE:
        n_fixed += text.count(bad)
        text = text.replace(bad, good)
    # One "\n" separates stories; "\n\n" separates paragraphs inside a story.
    stories = [s.strip() for s in re.split(r"(?<!\n)\n(?!\n)", text)]
    stories = [re.sub(r"\n{3,}", "\n\n", s) for s in stories if s]
    return stories, n_fixed


def split_train_val(stories: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Hold out the tail of the corpus, cut at the story boundary nearest to (1 - val_fraction)."""
    total = sum(len(s) for s in stories)
    target = total * (1.0 - val_fraction)
    acc = 0
    cut = len(stories) - 1
    for i, s in enumerate(stories):
        if acc + len(s) / 2 >= target:
            cut = i
            break
        acc += len(s)
    cut = max(1, min(cut, len(stories) - 1))
    return stories[:cut], stories[cut:]


def train_tokenizer(train_stories: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_stories, trainer=trainer, length=len(train_stories))
    # Encoding with special tokens prepends <|endoftext|> (the token every training story follows),
    # so `tok("Once upon a time")` / mlx_lm.generate prompts start like a new story.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, tok.token_to_id(EOT))]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    return hf_tok


def encode_stream(hf_tok, stories: list[str]) -> list[int]:
    """<|endoftext|> story <|endoftext|> story ... (EOT before every story and at the end)."""
    eot = hf_tok.convert_tokens_to_ids(EOT)
    enc = hf_tok(stories, add_special_tokens=False)["input_ids"]
    out = [eot]
    for ids in enc:
        out.extend(ids)
        out.append(eot)
    return out


def count_params(model, cfg) -> dict:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    per_expert = experts // (cfg.num_hidden_layers * cfg.num_experts)
    active = total - experts + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert
    if cfg.tie_word_embeddings:
        active += cfg.vocab_size * cfg.hidden_size  # tied lm_head is still a matmul per token
    return {
        "total": total,
        "experts": experts,
        "per_expert": per_expert,
        "active_per_token": active,
        "non_expert": total - experts,
    }


def main() -> None:
    args = parse_args()
    t_start = time.time()
    started_at = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")

    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    corpus = args.corpus.resolve()
    out_dir = args.out.resolve()
    corpus_sha = sha256_file(corpus)
    log(f"corpus {corpus} ({corpus.stat().st_size:,} bytes, sha256 {corpus_sha})")

    # ---------------------------------------------------------------- data + tokenizer
    stories, n_fixed = load_stories(corpus)
    train_stories, val_stories = split_train_val(stories, args.val_fraction)
    log(
        f"{len(stories)} stories ({n_fixed} mojibake sequences repaired): "
        f"{len(train_stories)} train / {len(val_stories)} val"
    )

    hf_tok = train_tokenizer(train_stories, args.vocab_size)
    vocab_size = len(hf_tok)
    eot_id = hf_tok.convert_tokens_to_ids(EOT)
    train_ids = torch.tensor(encode_stream(hf_tok, train_stories), dtype=torch.long)
    val_ids = torch.tensor(encode_stream(hf_tok, val_stories), dtype=torch.long)
    train_chars = sum(len(s) for s in train_stories)
    log(
        f"tokenizer: byte-level BPE, vocab {vocab_size} (eot id {eot_id}); "
        f"train {len(train_ids):,} tokens ({train_chars / len(train_ids):.2f} chars/token), "
        f"val {len(val_ids):,} tokens"
    )

    T = args.seq_len
    # validation: non-overlapping windows of T+1 tokens (last partial window dropped)
    n_val_win = (len(val_ids) - 1) // T
    val_x = torch.stack([val_ids[i * T : i * T + T] for i in range(n_val_win)])
    val_y = torch.stack([val_ids[i * T + 1 : i * T + T + 1] for i in range(n_val_win)])

    # unigram baseline: train-set token distribution (add-one smoothed), scored on val targets
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp_uni = torch.log(counts / counts.sum())
    unigram_loss = float(-logp_uni[val_y.reshape(-1)].mean())
    log(f"unigram-baseline val loss {unigram_loss:.4f} on {val_y.numel():,} val targets")

    # ---------------------------------------------------------------- model
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=4
        * args.hidden_size,  # unused: every layer is MoE (needed by mlx-lm's config)
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=not args.untie_embeddings,
        attention_bias=False,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=args.moe_intermediate_size,
        num_experts=args.experts,
        num_experts_per_tok=args.experts_per_tok,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=args.router_aux_loss_coef,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    model = Qwen3MoeForCausalLM(cfg)
    model.train()
    pc = count_params(model, cfg)
    log(
        f"Qwen3MoeForCausalLM: {pc['total']:,} params ({pc['experts']:,} in experts, "
        f"{pc['active_per_token']:,} active per token); experts impl "
        f"{getattr(model.config, '_experts_implementation', '?')}"
    )

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    def lr_at(step: int) -> float:  # step is 0-based
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        prog = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        floor = args.lr * args.min_lr_ratio
        return floor + (args.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, prog)))

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        tot, n = 0.0, 0
        for i in range(0, n_val_win, 16):
            logits = model(
                input_ids=val_x[i : i + 16], output_router_logits=False, use_cache=False
            ).logits
            tot += float(
                F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)).float(),
                    val_y[i : i + 16].reshape(-1),
                    reduction="sum",
                )
            )
            n += val_y[i : i + 16].numel()
        model.train()
        return tot / n

    gen = torch.Generator().manual_seed(args.seed)
    max_start = len(train_ids) - T - 1

    def get_batch():
        starts = torch.randint(0, max_start + 1, (args.batch_size,), generator=gen)
        x = torch.stack([train_ids[s : s + T] for s in starts])
        y = torch.stack([train_ids[s + 1 : s + T + 1] for s in starts])
        return x, y

    # ---------------------------------------------------------------- train
    init_val = evaluate()
    log(f"step 0: val {init_val:.4f} (uniform would be {math.log(vocab_size):.4f})")
    history = []
    best = (float("inf"), -1, None)
    t_train = time.time()
    tokens_seen = 0
    run_ce = run_aux = 0.0
    run_n = 0
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, y = get_batch()
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)).float(), y.reshape(-1))
        aux = out.aux_loss
        loss = ce + cfg.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tokens_seen += x.numel()
        run_ce += ce.item()
        run_aux += aux.item()
        run_n += 1
        s = step + 1
        if s % args.log_every == 0 or s == args.steps:
            el = time.time() - t_train
            log(
                f"step {s}/{args.steps} train ce {run_ce / run_n:.4f} aux {run_aux / run_n:.3f} "
                f"gnorm {float(gnorm):.2f} lr {lr_at(step):.2e} | {tokens_seen:,} tok, "
                f"{tokens_seen / el:.0f} tok/s, {el / 60:.1f} min, "
                f"epoch {tokens_seen / len(train_ids):.2f}"
            )
            history.append({"step": s, "train_ce": run_ce / run_n, "aux": run_aux / run_n})
            run_ce = run_aux = 0.0
            run_n = 0
        if s % args.eval_every == 0 or s == args.steps:
            v = evaluate()
            history[-1]["val"] = v if history and history[-1]["step"] == s else None
            tag = ""
            if v < best[0]:
                best = (v, s, {k: t.detach().clone() for k, t in model.state_dict().items()})
                tag = " (best)"
            log(f"step {s}: val loss {v:.4f}{tag}")
    train_time = time.time() - t_train
    final_val = evaluate()
    best_val, best_step, best_state = best
    if not args.no_keep_best and best_state is not None and best_step != args.steps:
        model.load_state_dict(best_state)
        log(
            f"restored best weights from step {best_step} "
            f"(val {best_val:.4f}; final was {final_val:.4f})"
        )
    export_step = best_step if not args.no_keep_best else args.steps
    export_val = evaluate()
    log(
        f"training done in {train_time / 60:.1f} min, {tokens_seen:,} tokens; exported weights: "
        f"step {export_step}, val loss {export_val:.4f}; unigram baseline {unigram_loss:.4f}"
    )

    # ---------------------------------------------------------------- save HF + convert
    tmp_root = Path(tempfile.mkdtemp(prefix="tinystories-moe-"))
    hf_dir = args.hf_out.resolve() if args.hf_out else tmp_root / "hf"
    mlx_tmp = tmp_root / "mlx"
    model.save_pretrained(hf_dir)
    hf_tok.save_pretrained(hf_dir)
    # transformers 5.x writes `num_local_experts` and `rope_parameters`; mlx-lm's qwen3_moe
    # ModelArgs requires the classic `num_experts` and top-level `rope_theta` (as in the
    # Qwen/Qwen3-*-A*B hub configs). Add them; transformers reads both spellings.
    cfg_path = hf_dir / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json["num_experts"] = args.experts
    cfg_json["rope_theta"] = args.rope_theta
    cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    log(f"saved HF checkpoint to {hf_dir}")

    convert_cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "convert",
        "--hf-path",
        str(hf_dir),
        "--mlx-path",
        str(mlx_tmp),
        "-q",
        "--q-bits",
        str(args.q_bits),
        "--q-group-size",
        str(args.q_group_size),
        "--dtype",
        args.dtype,
    ]
    log("running: " + shlex.join(convert_cmd))
    subprocess.run(convert_cmd, check=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.iterdir():  # replace any previous model files
        if f.is_file():
            f.unlink()
    for f in sorted(mlx_tmp.iterdir()):
        shutil.copy2(f, out_dir / f.name)
    # mlx-lm re-saves the tokenizer with transformers 5.x, which names the class
    # "TokenizersBackend" (unknown to transformers 4.x) and adds loader-state keys. Use the
    # portable class name; transformers 5.x maps PreTrainedTokenizerFast to the same backend.
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("is_local", "local_files_only", "backend"):
        tc.pop(k, None)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")

    # ---------------------------------------------------------------- check the MLX model
    import mlx.core as mx
    import mlx_lm

    mlx_model, mlx_tok = mlx_lm.load(str(out_dir))
    tot, n = 0.0, 0
    for i in range(n_val_win):
        logits = mlx_model(mx.array(val_x[i : i + 1].numpy()))
        ls = mx.logsumexp(logits[0].astype(mx.float32), axis=-1)
        tgt = mx.array(val_y[i].numpy())
        picked = mx.take_along_axis(logits[0].astype(mx.float32), tgt[:, None], axis=-1)[:, 0]
        tot += float(mx.sum(ls - picked))
        n += tgt.size
    mlx_val = tot / n
    sample = mlx_lm.generate(
        mlx_model, mlx_tok, prompt=args.sample_prompt, max_tokens=args.sample_tokens
    )
    log(f"MLX {args.q_bits}-bit val loss {mlx_val:.4f}")
    log(f"greedy sample: {args.sample_prompt!r} -> {sample!r}")

    files = [f for f in sorted(out_dir.iterdir()) if f.is_file() and f.name != "README.md"]
    size_bytes = sum(f.stat().st_size for f in files)
    total_time = time.time() - t_start

    # ---------------------------------------------------------------- README
    try:
        rel_corpus = os.path.relpath(corpus, REPO_ROOT)
    except ValueError:
        rel_corpus = str(corpus)
    argv = [a if not Path(a).is_absolute() else os.path.relpath(a, REPO_ROOT) for a in sys.argv[1:]]
    script_rel = os.path.relpath(Path(__file__).resolve(), REPO_ROOT)
    cmd = "python " + shlex.join([script_rel] + argv)
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "mlx": mx.__version__,
        "mlx-lm": getattr(mlx_lm, "__version__", "?"),
    }
    hist_rows = "\n".join(
        f"| {h['step']} | {h['train_ce']:.3f} | {h['aux']:.3f} | "
        f"{'' if h.get('val') is None else format(h['val'], '.3f')} |"
        for h in history
        if h.get("val") is not None
    )
    file_rows = "\n".join(f"| `{f.name}` | {f.stat().st_size:,} |" for f in files)
    attn_row = (
        f"| attention | {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads, "
        f"head_dim {cfg.head_dim}, q/k RMSNorm, RoPE theta {args.rope_theta:g} |"
    )
    convert_doc = (
        f"python -m mlx_lm convert --hf-path HF_DIR --mlx-path OUT -q --q-bits {args.q_bits} "
        f"--q-group-size {args.q_group_size} --dtype {args.dtype}"
    )
    sample_call = (
        f"mlx_lm.generate(..., prompt={args.sample_prompt!r}, max_tokens={args.sample_tokens})"
    )
    version_str = ", ".join(f"{k} {v}" for k, v in versions.items())
    mojibake_doc = "`â€œ`/`â€` -> `\"`, `â€™` -> `'`, `â€“`/`â€”` -> `-`"
    readme = f"""# tinystories-moe: ExpertStream's embedded default model

A tiny **Qwen3-MoE** language model (`model_type: qwen3_moe`) trained from scratch on CPU on a
TinyStories sample, then converted to MLX 4-bit. It exists so that ExpertStream has a small real MoE
checkpoint to stream experts from (tests, demos, benchmarks). It writes simple children's stories;
it is not a useful assistant.

Produced by `{script_rel}` on {started_at}.

## Corpus

- File: `{rel_corpus}` (relative to the repository root), {corpus.stat().st_size:,} bytes,
  sha256 `{corpus_sha}`.
- Content: the first stories of the TinyStories train split (Eldan & Li 2023,
  `roneneldan/TinyStories`, licence CDLA-Sharing-1.0; models trained on it are not restricted).
  See `../shared/data/corpora/README.md` for provenance.
- Preprocessing: {n_fixed} mojibake sequences repaired ({mojibake_doc});
  split into {len(stories)} stories at single newlines (blank lines inside a story are kept).
- Split: the first {len(train_stories)} stories for training ({len(train_ids):,} tokens), the last
  {len(val_stories)} stories (~{args.val_fraction:.0%} of the text, {len(val_ids):,} tokens) held
  out for validation. Token stream: `<|endoftext|>` before every story.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training stories: vocabulary {vocab_size}
(256 byte symbols + merges + the special token), `{EOT}` (id {eot_id}) is bos, eos and pad, no chat
template. Encoding with `add_special_tokens=True` (the default, also used by `mlx_lm.generate`)
prepends `<|endoftext|>`, which is how every training story starts. Saved as a Hugging Face fast
tokenizer (`tokenizer.json` + `tokenizer_config.json`), loadable with `transformers.AutoTokenizer`.
About {train_chars / len(train_ids):.2f} characters per token on the training text.

## Architecture

`Qwen3MoeForCausalLM` (transformers {versions["transformers"]}):

| field | value |
|---|---|
| hidden_size | {cfg.hidden_size} |
| num_hidden_layers | {cfg.num_hidden_layers} (all MoE: `decoder_sparse_step` 1, \
`mlp_only_layers` []) |
{attn_row}
| experts per layer | {cfg.num_experts} (SwiGLU, \
`moe_intermediate_size` {cfg.moe_intermediate_size}) |
| experts per token | {cfg.num_experts_per_tok}, `norm_topk_prob` true |
| router aux loss | load-balancing loss, `router_aux_loss_coef` {cfg.router_aux_loss_coef} |
| vocab_size | {vocab_size} |
| tie_word_embeddings | {str(cfg.tie_word_embeddings).lower()} |
| max_position_embeddings | {cfg.max_position_embeddings} (trained on {T}-token windows) |

Parameters: **{pc["total"]:,}** in total, of which {pc["experts"]:,} in experts
({pc["per_expert"]:,} per expert, {cfg.num_hidden_layers} x {cfg.num_experts} experts) and
{pc["non_expert"]:,} elsewhere; about {pc["active_per_token"]:,} are used per token
(counting the tied output projection).

## Training

- PyTorch {versions["torch"]} on CPU, {args.threads} threads, seed {args.seed}.
- AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices except the embedding),
  peak lr {args.lr:g}, {args.warmup_steps} warmup steps then cosine decay to
  {args.lr * args.min_lr_ratio:g}, gradient clipping {args.grad_clip}.
- {args.steps} steps x batch {args.batch_size} x {T} tokens (random windows) =
  **{tokens_seen:,} tokens seen** (~{tokens_seen / len(train_ids):.1f} epochs of the training
  split).
- Loss: cross-entropy + {cfg.router_aux_loss_coef} x router load-balancing loss.
- Wall time: **{train_time / 60:.1f} min** of training ({tokens_seen / train_time:.0f} tokens/s);
  {total_time / 60:.1f} min for the whole script (tokenizer, training, conversion, checks).
- Validation every {args.eval_every} steps; the exported weights are those of step **{export_step}**
  ({"best validation loss" if not args.no_keep_best else "final step"}).

| step | train CE | router aux | val loss |
|---|---|---|---|
{hist_rows}

## Results (held-out validation, nats per token)

| model | val loss |
|---|---|
| uniform over the vocabulary | {math.log(vocab_size):.4f} |
| unigram baseline (training-set token frequencies, add-one smoothed) | {unigram_loss:.4f} |
| this model, PyTorch float32 (exported weights, step {export_step}) | **{export_val:.4f}** |
| this model, PyTorch float32, final step {args.steps} | {final_val:.4f} |
| this model, MLX {args.q_bits}-bit (this folder) | {mlx_val:.4f} |

Greedy sample from this folder (`{sample_call}`):

> {args.sample_prompt}{sample.replace(chr(10), " ")}

## Conversion

The PyTorch checkpoint was saved with `save_pretrained` (float32) and converted exactly like
mlx-community checkpoints, with mlx-lm's converter, **{args.q_bits}-bit affine quantization, group
size {args.q_group_size}, {args.dtype} for the unquantized tensors** (MLX's CPU `gather_qmm` is much
faster in float32 than bfloat16):

    {convert_doc}

mlx-lm's qwen3_moe `quant_predicate` keeps the routers (`mlp.gate`) at 8 bits. Before converting,
the script adds `num_experts` and `rope_theta` to the HF `config.json`: transformers 5.x writes
`num_local_experts` and `rope_parameters` instead, and mlx-lm's `qwen3_moe.ModelArgs` requires the
classic field names (which the Qwen/Qwen3 hub configs use). Both spellings are in the final config.
After conversion `tokenizer_config.json` gets `tokenizer_class: PreTrainedTokenizerFast`
(transformers 5.x writes `TokenizersBackend`, which transformers 4.x cannot resolve).

Files ({size_bytes:,} bytes in total, plus this README):

| file | bytes |
|---|---|
{file_rows}

## Reproduce

From the repository root:

    {cmd}

Versions: {version_str}. Training on CPU is deterministic for a given seed and thread count up to
floating-point non-determinism of the kernels; timings depend on the machine and its load.
"""
    (out_dir / "README.md").write_text(readme)
    shutil.rmtree(tmp_root, ignore_errors=True)
    log(f"wrote {out_dir} ({size_bytes / 1e6:.2f} MB); total {total_time / 60:.1f} min")


if __name__ == "__main__":
    main()
