#!/usr/bin/env python
"""Train splitserve's bundled demo checkpoint (engine/demo_model/).

A small Jamba-architecture model (attention + Mamba layers, two of them
mixture-of-experts) trained from scratch on text every machine has: the
``.py`` files of the running Python's standard library. Every 20th file
(in sorted path order) is held out for evaluation. The tokenizer is a
byte-level BPE trained with the ``tokenizers`` library on the training
files only.

Reproduce the committed checkpoint (about 30 minutes on 2 CPU cores; not
run in CI):

    python scripts/train_demo_model.py --out engine/demo_model

The run is seeded; with the same Python version (the stdlib is the corpus),
torch build and thread count, it gives the same weights. The script ends by
loading the saved folder with transformers (AutoModelForCausalLM +
AutoTokenizer), checking that HF's Jamba forward reproduces the logits of
the training-time forward (``scripts/demo_jamba_fast.py``), measuring held-out
loss against a unigram baseline, generating a greedy sample, and writing the
model card (README.md) next to the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_jamba_fast import fast_forward, load_balancing_loss  # noqa: E402

EOS = "<|endoftext|>"
SAMPLE_PROMPT = "def fibonacci(n):\n"
KEEP_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "README.md",
}
# Directories of the stdlib that are not library source: test suites,
# third-party packages, build configuration.
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "__phello__"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- data


def stdlib_files(root: Path, max_bytes: int) -> tuple[list[tuple[str, str]], dict]:
    """Sorted (relative path, text) of the stdlib's library .py files, and skip counts."""
    skipped = {"generated or machine-specific": 0, "too large": 0}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-") and not d.startswith("lib-")
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = (rel_dir / name).as_posix()
            path = Path(dirpath) / name
            # _sysconfigdata* differs per machine/build; pydoc_data/topics.py is
            # generated documentation text.
            if name.startswith("_sysconfigdata") or rel.startswith("pydoc_data/"):
                skipped["generated or machine-specific"] += 1
                continue
            if path.stat().st_size > max_bytes:
                skipped["too large"] += 1
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            # Generated character-map codecs (encodings/cp*.py etc.) are big tables.
            if "gencodec.py" in text:
                skipped["generated or machine-specific"] += 1
                continue
            out.append((rel, text))
    out.sort(key=lambda rt: rt[0])
    return out, skipped


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_stream(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- model


def build_model(args, vocab_size: int, eos_id: int):
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        attn_layer_period=args.attn_period,
        attn_layer_offset=args.attn_offset,
        expert_layer_period=args.expert_period,
        expert_layer_offset=args.expert_offset,
        num_experts=args.experts,
        num_experts_per_tok=args.experts_per_tok,
        mamba_d_state=args.d_state,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        router_aux_loss_coef=args.aux_coef,
        use_cache=True,
    )
    model = JambaForCausalLM(config)
    # Mamba's usual time-step init (HF leaves dt_proj.bias at 0, i.e. dt ~ 0.69 for
    # every channel): dt log-uniform in [1e-3, 1e-1] through the softplus.
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "mamba"):
                m = layer.mamba
                dt = torch.exp(
                    torch.rand(m.intermediate_size) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
                ).clamp(min=1e-4)
                m.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                bound = m.time_step_rank**-0.5
                m.dt_proj.weight.uniform_(-bound, bound)
    return model


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name.endswith("A_log") or "embed_tokens" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, batch: int) -> tuple[float, int, torch.Tensor]:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of the held-out stream."""
    model.eval()
    n_win = (len(stream) - 1) // seq_len
    starts = torch.arange(n_win) * seq_len
    total, count = 0.0, 0
    for i in range(0, n_win, batch):
        s = starts[i : i + batch]
        x = torch.stack([stream[j : j + seq_len] for j in s.tolist()])
        y = torch.stack([stream[j + 1 : j + seq_len + 1] for j in s.tolist()])
        logits, _ = fast_forward(model, x)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    targets = torch.cat([stream[j + 1 : j + seq_len + 1] for j in starts.tolist()])
    model.train()
    return total / count, count, targets


def unigram_loss(train_stream: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0  # add-one smoothing
    logp = torch.log(counts / counts.sum())
    return -logp[targets].mean().item()


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="engine/demo_model", help="output folder (replaced)")
    ap.add_argument("--stdlib", default=None, help="stdlib folder (default: the running Python's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is robust on a shared machine)")
    ap.add_argument("--heldout-every", type=int, default=20, help="hold out files i with i %% N == N-1")
    ap.add_argument("--max-file-bytes", type=int, default=200_000)
    ap.add_argument("--vocab-size", type=int, default=4096)
    # model
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--attn-period", type=int, default=3)
    ap.add_argument("--attn-offset", type=int, default=1)
    ap.add_argument("--expert-period", type=int, default=3)
    ap.add_argument("--expert-offset", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--experts-per-tok", type=int, default=2)
    ap.add_argument("--d-state", type=int, default=16)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    # training
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--scan-block", type=int, default=16)
    ap.add_argument("--max-minutes", type=float, default=0.0, help="stop training early after this long (0: never)")
    ap.add_argument("--stop-after-steps", type=int, default=0,
                    help="stop after this many steps of the --steps schedule (0: never); replays a time-limited run")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--sample-tokens", type=int, default=80)
    ap.add_argument("--eval-max-tokens", type=int, default=0, help="evaluate on a prefix of the held-out stream (0: all; for smoke tests)")
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    # ---- data
    root = Path(args.stdlib or sysconfig.get_paths()["stdlib"]).resolve()
    files, skipped = stdlib_files(root, args.max_file_bytes)
    if not files:
        sys.exit(f"no .py files found under {root}")
    heldout = [f for i, f in enumerate(files) if i % args.heldout_every == args.heldout_every - 1]
    train = [f for i, f in enumerate(files) if i % args.heldout_every != args.heldout_every - 1]
    train_chars = sum(len(t) for _, t in train)
    heldout_chars = sum(len(t) for _, t in heldout)
    log(f"stdlib {root} (Python {platform.python_version()}): {len(files)} files, "
        f"{len(train)} train ({train_chars / 1e6:.2f}M chars), {len(heldout)} held out ({heldout_chars / 1e6:.2f}M chars); "
        f"skipped {skipped}")

    # ---- tokenizer
    t0 = time.time()
    tok = train_tokenizer([t for _, t in train], args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    vocab_size = tok.get_vocab_size()
    for _, text in heldout[:50]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text, "tokenizer does not round-trip"
    train_stream = encode_stream(tok, [t for _, t in train], eos_id)
    heldout_stream = encode_stream(tok, [t for _, t in heldout], eos_id)
    log(f"tokenizer: vocab {vocab_size}, {time.time() - t0:.0f}s; train {len(train_stream):,} tokens "
        f"({train_chars / len(train_stream):.2f} chars/token), held-out {len(heldout_stream):,} tokens")

    # ---- model
    model = build_model(args, vocab_size, eos_id)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} params; layers {cfg.layers_block_type}; experts/layer {cfg.layers_num_experts}")

    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    L = args.seq_len
    max_start = len(train_stream) - L - 1
    offs = torch.arange(L + 1)

    # ---- train
    model.train()
    t_train = time.time()
    steps_done = 0
    stopped_early = False
    recent = []
    for step in range(args.steps):
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, max_start, (args.batch_size,), generator=gen)
        batch = train_stream[starts[:, None] + offs]
        logits, router_logits = fast_forward(model, batch[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, vocab_size), batch[:, 1:].reshape(-1))
        aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok)
        loss = ce + cfg.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        steps_done = step + 1
        recent.append(ce.item())
        if steps_done % args.log_every == 0 or steps_done == args.steps:
            el = time.time() - t_train
            log(f"step {steps_done}/{args.steps} loss {sum(recent) / len(recent):.3f} aux {aux.item():.3f} "
                f"lr {lr:.2e} {steps_done * args.batch_size * L / el:.0f} tok/s elapsed {el / 60:.1f} min")
            recent = []
        if args.max_minutes and time.time() - t_train > args.max_minutes * 60:
            stopped_early = steps_done < args.steps
            log(f"time limit reached after {steps_done} steps")
            break
        if args.stop_after_steps and steps_done >= args.stop_after_steps:
            stopped_early = steps_done < args.steps
            log(f"stopping after {steps_done} steps as asked (schedule planned for {args.steps})")
            break
    train_seconds = time.time() - t_train
    tokens_seen = steps_done * args.batch_size * L
    model.eval()

    # ---- evaluate
    t0 = time.time()
    eval_stream = heldout_stream[: args.eval_max_tokens] if args.eval_max_tokens else heldout_stream
    loss_val, n_eval, targets = heldout_loss(model, eval_stream, L, 16)
    uni = unigram_loss(train_stream, targets, vocab_size)
    log(f"held-out: loss {loss_val:.4f} nats/token (ppl {math.exp(loss_val):.2f}) over {n_eval:,} tokens; "
        f"unigram {uni:.4f} (ppl {math.exp(uni):.1f}); {time.time() - t0:.0f}s")

    # ---- save
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False, max_new_tokens=128
    )
    model.save_pretrained(out, safe_serialization=True)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        model_max_length=args.max_positions,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out)
    # Name the class every transformers version knows (v5 maps it to its tokenizers backend).
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.pop("backend", None)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    for p in out.iterdir():
        p.chmod(0o644)
    for p in out.iterdir():
        if p.name not in KEEP_FILES:
            p.unlink() if p.is_file() else shutil.rmtree(p)

    # ---- verify with transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf.eval()
    tok2 = AutoTokenizer.from_pretrained(out)
    text0 = heldout[0][1][:4000]
    assert tok2.decode(tok2(text0)["input_ids"]) == text0, "AutoTokenizer does not round-trip"
    assert tok2(text0)["input_ids"] == tok.encode(text0).ids
    check = torch.stack([heldout_stream[0:L], heldout_stream[L : 2 * L]])
    with torch.no_grad():
        ref = hf(check).logits
        mine, _ = fast_forward(model, check)
        mine_loaded, _ = fast_forward(hf, check)
    max_diff = (ref - mine).abs().max().item()
    max_diff_loaded = (ref - mine_loaded).abs().max().item()
    hf_loss = F.cross_entropy(ref[:, :-1].reshape(-1, vocab_size), check[:, 1:].reshape(-1)).item()
    my_loss = F.cross_entropy(mine[:, :-1].reshape(-1, vocab_size), check[:, 1:].reshape(-1)).item()
    log(f"verify: HF JambaForCausalLM vs training forward on {check.numel()} held-out tokens: "
        f"max |logit diff| {max_diff:.2e} (trained model), {max_diff_loaded:.2e} (reloaded weights); "
        f"loss {hf_loss:.5f} vs {my_loss:.5f}")
    if max_diff > 1e-3:
        sys.exit("HF forward does not match the training forward")

    # ---- sample
    enc = tok2(SAMPLE_PROMPT, return_tensors="pt")
    with torch.no_grad():
        gen_ids = hf.generate(**enc, max_new_tokens=args.sample_tokens, do_sample=False)
    sample = tok2.decode(gen_ids[0], skip_special_tokens=False)
    log("sample:\n" + sample)

    # ---- model card
    size_bytes = sum(p.stat().st_size for p in out.iterdir())
    weights_bytes = (out / "model.safetensors").stat().st_size
    total_seconds = time.time() - t_start
    cmd = "python scripts/train_demo_model.py " + " ".join(sys.argv[1:])
    stats = dict(
        python=platform.python_version(),
        torch=torch.__version__,
        n_files=len(files),
        n_train=len(train),
        n_heldout=len(heldout),
        skipped=skipped,
        train_chars=train_chars,
        heldout_chars=heldout_chars,
        train_tokens=len(train_stream),
        heldout_tokens=len(heldout_stream),
        vocab_size=vocab_size,
        n_params=n_params,
        steps=steps_done,
        tokens_seen=tokens_seen,
        train_seconds=train_seconds,
        total_seconds=total_seconds,
        loss=loss_val,
        n_eval=n_eval,
        unigram=uni,
        max_diff=max_diff,
        sample=sample,
        weights_bytes=weights_bytes,
        size_bytes=size_bytes,
        cmd=cmd,
        stopped_early=stopped_early,
        heldout_names=[r for r, _ in heldout],
    )
    (out / "README.md").write_text(model_card(args, cfg, stats))
    size_bytes = sum(p.stat().st_size for p in out.iterdir())
    log(f"wrote {out}: {sorted(p.name for p in out.iterdir())}, {size_bytes / 2**20:.2f} MiB; "
        f"total {total_seconds / 60:.1f} min")
    print(json.dumps({k: v for k, v in stats.items() if k not in ("sample", "heldout_names")}, indent=1))


def model_card(args, cfg, s: dict) -> str:
    layers = ", ".join(
        f"{i}: {kind}{' + MoE' if ne > 1 else ''}"
        for i, (kind, ne) in enumerate(zip(cfg.layers_block_type, cfg.layers_num_experts))
    )
    fence = "```"
    early = (
        f"\n**Note:** training hit the `--max-minutes {args.max_minutes}` limit and stopped after {s['steps']} of "
        f"{args.steps} planned steps.\n"
        if s["stopped_early"]
        else ""
    )
    skipped = ", ".join(f"{v} {k}" for k, v in s["skipped"].items())
    return f"""# splitserve demo model

A tiny Jamba-architecture language model (attention + Mamba layers, with
mixture-of-experts layers) that ships inside the repository so that
splitserve can serve something real on a fresh machine with no download.
It was trained from scratch for about {s['train_seconds'] / 60:.0f} minutes on a small CPU
machine, on the source code of Python's standard library, so it writes
Python-looking code. It is a demo: do not expect correct programs.

Files: `config.json` (`model_type: "jamba"`), `model.safetensors`
(float32), `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json`. It loads with `transformers`:

{fence}python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("engine/demo_model")
tokenizer = AutoTokenizer.from_pretrained("engine/demo_model")
{fence}

## Data

- Corpus: the `.py` files of the CPython {s['python']} standard library
  (`sysconfig.get_paths()["stdlib"]`), walked in sorted path order, without
  `site-packages`, test suites (`test/`, `tests/`, `idle_test/`),
  `config-*` / `lib-dynload`, and files that are generated,
  machine-specific or over {args.max_file_bytes // 1000} kB ({skipped}).
- {s['n_files']} files: {s['n_train']} for training ({s['train_chars'] / 1e6:.2f}M characters,
  {s['train_tokens']:,} tokens) and {s['n_heldout']} held out for evaluation
  ({s['heldout_chars'] / 1e6:.2f}M characters, {s['heldout_tokens']:,} tokens). Held-out rule:
  file number i (0-based, sorted order) is held out when
  i % {args.heldout_every} == {args.heldout_every - 1}; for example `{s['heldout_names'][0]}`,
  `{s['heldout_names'][1]}`, `{s['heldout_names'][2]}`.
- Each file is followed by `<|endoftext|>` in the token stream.

## Tokenizer

Byte-level BPE trained with the `tokenizers` library on the training files
only: vocabulary {s['vocab_size']} (256 byte symbols, merges, and `<|endoftext|>`,
id {cfg.eos_token_id}, used as BOS, EOS and padding). It round-trips any text
losslessly (ByteLevel decoder). No BOS is added to prompts. About
{s['train_chars'] / s['train_tokens']:.2f} characters per token on the training set.

## Architecture and size

`JambaForCausalLM`, {s['n_params']:,} parameters ({s['weights_bytes'] / 2**20:.1f} MiB of float32
safetensors; input and output embeddings are tied, so there is no
`lm_head.weight` tensor in the file).

- hidden size {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({layers})
- attention: {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} key/value heads, head dim
  {cfg.hidden_size // cfg.num_attention_heads}, no positional embeddings (as in Jamba)
- Mamba: d_state {cfg.mamba_d_state}, d_conv {cfg.mamba_d_conv}, expand {cfg.mamba_expand}, dt_rank {cfg.mamba_dt_rank}
- feed-forward: SwiGLU, intermediate size {cfg.intermediate_size}; MoE layers have
  {cfg.num_experts} experts, top-{cfg.num_experts_per_tok} routing (router weights not renormalised, as in HF Jamba)
- vocabulary {cfg.vocab_size}, trained at sequence length {args.seq_len}; `max_position_embeddings`
  {cfg.max_position_embeddings}

## Training

- {s['steps']} steps of AdamW (betas 0.9/0.95, weight decay {args.weight_decay}, gradient clip
  {args.clip}), batch {args.batch_size} x {args.seq_len} tokens (random windows of the
  training stream), learning rate {args.lr:g} with {args.warmup} warm-up steps and cosine
  decay to {args.min_lr:g}; router load-balancing loss weight {cfg.router_aux_loss_coef:g}.
  Seed {args.seed}.
- {s['tokens_seen']:,} tokens seen (about {s['tokens_seen'] / s['train_tokens']:.2f} epochs).
- Training time {s['train_seconds'] / 60:.1f} min ({s['total_seconds'] / 60:.1f} min for the whole script,
  tokenizer and evaluation included) on a 2-core CPU machine shared with other
  work: torch {s['torch']} with {args.threads} thread(s), under `nice`.
- The training-time forward (`scripts/demo_jamba_fast.py`) uses the
  parameters of a real `transformers` `JambaForCausalLM` with a faster
  selective scan; after saving, the script reloads the folder with
  `AutoModelForCausalLM` and checks HF's own forward against it on held-out
  text: max |logit difference| {s['max_diff']:.1e}.
{early}
## Evaluation (held-out files)

Next-token cross-entropy on the {s['n_eval']:,} predicted tokens of the held-out
files (non-overlapping windows of {args.seq_len} tokens), in nats per token on
the same tokenization:

| model | loss (nats/token) | perplexity |
|---|---|---|
| this model | {s['loss']:.3f} | {math.exp(s['loss']):.2f} |
| unigram baseline (train-set token frequencies, add-one smoothing) | {s['unigram']:.3f} | {math.exp(s['unigram']):.1f} |

## Sample

Greedy continuation (`generate(do_sample=False, max_new_tokens={args.sample_tokens})`) of
`"def fibonacci(n):\\n"`:

{fence}python
{s['sample']}
{fence}

## Reproduce

{fence}
{s['cmd']}
{fence}

(Python {s['python']}: the corpus is the running interpreter's standard
library, so another Python version gives a slightly different model.)
"""


if __name__ == "__main__":
    main()
