"""Train dabba's bundled demo model on the CPU: a small Llama (RMSNorm, RoPE, SwiGLU, grouped-query
attention, tied embeddings) and a byte-level BPE tokenizer, on the text of the Python 3.11
documentation (Debian's python3.11-doc: the reST sources under html/_sources; PSF License).

    apt-get install python3.11-doc
    python -m tools.train_demo_model --out dabba/assets/demo            # ~27 min on 2 cores

A draft model for speculative decoding must share the demo model's tokenizer: --tokenizer takes it
from a model directory instead of training one, for example

    python -m tools.train_demo_model --out /tmp/demo-draft --tokenizer dabba/assets/demo \
        --hidden-size 128 --num-layers 2 --num-heads 2 --num-kv-heads 1 --intermediate-size 384

Reproducible from --seed: the document split, tokenizer, initialisation and batch order all
derive from it. Documents are split, not lines: every 12th document (sorted by path) is held
out and never trained on. Hyperparameters are the argparse defaults below; they are also
written to training_args.json next to the model, with the loss curve (loss.png) and metrics.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

DOCS = Path("/usr/share/doc/python3.11/html/_sources")
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
LICENSE_NOTE = """Training data: the reStructuredText sources of the Python 3.11 documentation, as shipped
in Debian's python3.11-doc package (/usr/share/doc/python3.11/html/_sources).
Copyright (c) 2001-2023 Python Software Foundation; licensed under the PSF License Agreement
(and the Zero-Clause BSD license for code examples): https://docs.python.org/3/license.html
The model weights are derived from that text by tools/train_demo_model.py.
"""

_ROLE = re.compile(r":[a-zA-Z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)(?:\s*<[^>]*>)?`_+")


# Directives whose indented body is not prose.
_SKIP_BODY = ("code-block", "code", "highlight", "doctest", "testcode", "testoutput", "testsetup", "literalinclude",
              "productionlist", "toctree", "image", "figure", "index", "csv-table", "list-table", "raw", "only",
              "sourcecode", "program", "cmdoption", "option", "audit-event", "impl-detail", "include")


def clean_rst(text: str) -> str:
    """Prose out of reST: drop directive lines, section underlines, code and literal blocks and
    doctest lines (the prose inside directives such as function:: stays); turn roles
    (:func:`len`) and links into their text."""
    out, skip_indent = [], None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if stripped and indent <= skip_indent:
                skip_indent = None
            else:
                continue
        if stripped.startswith(".. "):
            name = stripped[3:].split("::", 1)[0].strip()
            if "::" not in stripped or name in _SKIP_BODY or name.startswith("_") or stripped.startswith(".. _"):
                skip_indent = indent
            continue
        if stripped.startswith(":") and re.match(r":[\w -]+:", stripped):  # field lists (:param x:, :noindex:)
            continue
        if re.fullmatch(r"[=\-~^\"'`#*+<>._:]{3,}", stripped) or stripped.startswith((">>>", "...", "|", "+-")):
            continue
        if stripped.endswith("::"):  # a literal block follows
            line = line.rstrip()[:-1] if stripped != "::" else ""
            skip_indent = indent
        line = _LINK.sub(r"\1", _ROLE.sub(r"\1", line)).replace("``", "").replace("**", "").replace("*", "")
        out.append(line.strip())
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def load_documents(seed: int) -> tuple[list[str], list[str]]:
    files = sorted(DOCS.rglob("*.txt"))
    if not files:
        raise SystemExit(f"no documents under {DOCS}: apt-get install python3.11-doc")
    docs = [(str(f.relative_to(DOCS)), clean_rst(f.read_text(errors="replace"))) for f in files]
    docs = [(name, text) for name, text in docs if len(text) > 200]
    held = {name for i, (name, _) in enumerate(docs) if i % 12 == seed % 12}
    train = [t for n, t in docs if n not in held]
    test = [t for n, t in docs if n in held]
    random.Random(seed).shuffle(train)
    return train, test


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_documents(tok, texts: list[str]) -> list[int]:
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eot]
    return ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="dabba/assets/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer", default=None,
                   help="a model directory whose tokenizer to use instead of training one (a draft model's target)")
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--heldout-chars", type=int, default=300_000, help="size of the committed held-out text")
    p.add_argument("--calibration-chars", type=int, default=100_000, help="size of the committed calibration text")
    args = p.parse_args()

    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, test_docs = load_documents(args.seed)
    (out / "heldout.txt").write_text("\n\n".join(test_docs)[: args.heldout_chars])
    (out / "calibration.txt").write_text("\n\n".join(train_docs)[: args.calibration_chars])
    (out / "DATA_LICENSE.txt").write_text(LICENSE_NOTE)

    if args.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_docs, args.vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja; older readers look in tokenizer_config.json
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    train_ids = torch.tensor(encode_documents(tok, train_docs))
    test_ids = torch.tensor(encode_documents(tok, test_docs))
    print(f"tokens: train {len(train_ids):,}, held-out {len(test_ids):,}; vocab {tok.get_vocab_size()}")

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.seq_len * 2, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=[tok.token_to_id("<|end|>"), tok.token_to_id("<|endoftext|>")],
        pad_token_id=tok.token_to_id("<|endoftext|>"), initializer_range=0.02,
    )
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {num_params / 1e6:.2f} M")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    n_windows = (len(train_ids) - 1) // args.seq_len
    eval_starts = torch.arange(0, len(test_ids) - args.seq_len - 1, args.seq_len)[:64]

    def batch(ids: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(args.seq_len + 1)[None]
        chunk = ids[idx]
        return chunk[:, :-1], chunk[:, 1:]

    @torch.no_grad()
    def heldout_loss() -> float:
        model.eval()
        losses = []
        for s in eval_starts.split(16):
            x, y = batch(test_ids, s)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
        model.train()
        return sum(losses) / len(losses)

    history = {"step": [], "train_loss": [], "eval_step": [], "heldout_loss": []}
    order = torch.randperm(n_windows, generator=gen)
    pos = 0
    start = time.time()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    smooth = None
    for step in bar:
        if pos + args.batch_size > len(order):
            order, pos = torch.randperm(n_windows, generator=gen), 0
        starts = order[pos:pos + args.batch_size] * args.seq_len
        pos += args.batch_size
        x, y = batch(train_ids, starts)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        history["step"].append(step)
        history["train_loss"].append(loss.item())
        tokens_per_s = (step + 1) * args.batch_size * args.seq_len / (time.time() - start)
        bar.set_postfix(loss=f"{smooth:.3f}", tok_s=f"{tokens_per_s:.0f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            history["eval_step"].append(step + 1)
            history["heldout_loss"].append(heldout_loss())
            bar.write(f"step {step + 1}: held-out loss {history['heldout_loss'][-1]:.3f} "
                      f"(perplexity {math.exp(history['heldout_loss'][-1]):.1f})")

    model.to(torch.bfloat16).save_pretrained(out)
    elapsed = time.time() - start
    metrics = {"parameters": num_params, "train_tokens": len(train_ids), "heldout_tokens": len(test_ids),
               "tokens_seen": args.steps * args.batch_size * args.seq_len, "minutes": elapsed / 60,
               "final_heldout_loss": history["heldout_loss"][-1],
               "final_heldout_perplexity": math.exp(history["heldout_loss"][-1])}
    (out / "training_args.json").write_text(json.dumps({**vars(args), **metrics}, indent=2))
    plot(history, out / "loss.png")
    print(json.dumps(metrics, indent=2))


def plot(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["train_loss"], lw=0.6, alpha=0.6, label="train (per step)")
    ax.plot(history["eval_step"], history["heldout_loss"], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("dabba demo model: Python 3.11 docs")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
