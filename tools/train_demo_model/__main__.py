"""Train dabba's bundled demo model on the CPU: a small Llama (RMSNorm, RoPE, SwiGLU, grouped-query
attention, tied embeddings) and a byte-level BPE tokenizer, on the prose of documentation that
Debian packages ship (corpus.py: each source and its licence), then tune it briefly on question
and answer pairs made from those documents (qa.py, sft.py) so that a chat gets short answers.

    apt-get install $(python -m tools.train_demo_model --packages)
    python -m tools.train_demo_model --out dabba/assets/demo

A draft model for speculative decoding must share the demo model's tokenizer: --tokenizer takes it
from a model directory instead of training one, for example

    python -m tools.train_demo_model --out /tmp/demo-draft --tokenizer dabba/assets/demo \
        --hidden-size 128 --num-layers 2 --num-heads 2 --num-kv-heads 1 --intermediate-size 384 --sft-steps 0

Reproducible from --seed: the document split, tokenizer, initialisation and batch order all
derive from it. --keep-pretrained DIR saves the pretrained model (float32) with its loss history
and generator state; --init-from DIR then redoes only the instruction stage, giving what the
whole run gives. Documents are split, not lines: every 12th document of each source (sorted by
path) is held out and never trained on, nor are the pairs made from it. --compare-heldout names
an older held-out text (by default the one the output directory held before) on which the new
model's perplexity is reported too. Hyperparameters are the argparse defaults below; they are
written to training_args.json next to the model, with the loss curve (loss.png), the metrics and
sample chats (samples.json).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

from tools.train_demo_model.corpus import SOURCES, licence_note, load_documents
from tools.train_demo_model import sft
from tools.train_demo_model.qa import qa_pairs

# what --init-from takes from the run that pretrained the model
PRETRAINING_ARGS = ("seed", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "intermediate_size", "seq_len", "batch_size", "steps", "lr", "warmup", "weight_decay",
                    "eval_every")
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


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
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--tokenizer", default=None,
                   help="a model directory whose tokenizer to use instead of training one (a draft model's target)")
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--heldout-chars", type=int, default=300_000, help="size of the committed held-out text")
    p.add_argument("--calibration-chars", type=int, default=100_000, help="size of the committed calibration text")
    p.add_argument("--sft-steps", type=int, default=300, help="instruction-tuning steps after pretraining (0: none)")
    p.add_argument("--sft-batch-size", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=2e-4)
    p.add_argument("--sft-prose-batch", type=int, default=8,
                   help="corpus windows whose plain loss joins each instruction step's (0: none)")
    p.add_argument("--compare-heldout", default=None,
                   help="an older held-out text to report perplexity on (default: OUT/heldout.txt before this run)")
    p.add_argument("--keep-pretrained", default=None,
                   help="also save the model as pretraining left it (float32) to this directory, with its "
                        "loss history, so that --init-from can redo the instruction stage alone")
    p.add_argument("--init-from", default=None,
                   help="a --keep-pretrained directory: skip pretraining, start from its model and tokenizer")
    p.add_argument("--packages", action="store_true", help="print the Debian packages of the corpus and exit")
    args = p.parse_args()
    if args.packages:
        print(" ".join(source.package for source in SOURCES))
        return

    import torch
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    pretraining = None
    if args.init_from:
        pretraining = json.loads((Path(args.init_from) / "pretraining.json").read_text())
        for key in PRETRAINING_ARGS:
            setattr(args, key, pretraining["args"][key])
        args.tokenizer = args.init_from
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    compare = Path(args.compare_heldout) if args.compare_heldout else out / "heldout.txt"
    old_heldout = compare.read_text() if compare.is_file() else None
    train_docs, test_docs = load_documents(args.seed)
    train_texts, test_texts = [d.text for d in train_docs], [d.text for d in test_docs]
    (out / "heldout.txt").write_text("\n\n".join(test_texts)[: args.heldout_chars])
    (out / "calibration.txt").write_text("\n\n".join(train_texts)[: args.calibration_chars])
    (out / "DATA_LICENSE.txt").write_text(licence_note())

    if args.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_texts, args.vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # transformers 5 writes the template to chat_template.jinja; older readers look in tokenizer_config.json
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    train_ids = torch.tensor(encode_documents(tok, train_texts))
    test_ids = torch.tensor(encode_documents(tok, test_texts))
    train_pairs = [p for d in train_docs for p in qa_pairs(d.rst, d.name)]
    test_pairs = [p for d in test_docs for p in qa_pairs(d.rst, d.name)]
    print(f"tokens: train {len(train_ids):,}, held-out {len(test_ids):,}; vocab {tok.get_vocab_size()}; "
          f"question-answer pairs: train {len(train_pairs):,}, held-out {len(test_pairs):,}")

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.seq_len * 2, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tok.token_to_id("<|endoftext|>"), eos_token_id=[tok.token_to_id("<|end|>"), tok.token_to_id("<|endoftext|>")],
        pad_token_id=tok.token_to_id("<|endoftext|>"), initializer_range=0.02,
    )
    config.architectures = ["LlamaForCausalLM"]
    model = (LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32) if args.init_from
             else LlamaForCausalLM(config))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {num_params / 1e6:.2f} M")

    gen = torch.Generator().manual_seed(args.seed)
    n_windows = (len(train_ids) - 1) // args.seq_len
    pad_id = tok.token_to_id("<|endoftext|>")

    def batch(ids: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(args.seq_len + 1)[None]
        chunk = ids[idx]
        return chunk[:, :-1], chunk[:, 1:]

    @torch.no_grad()
    def heldout_loss(ids: torch.Tensor = test_ids) -> float:
        """Mean loss over up to 64 windows of a held-out text."""
        model.eval()
        losses = []
        for s in torch.arange(0, len(ids) - args.seq_len - 1, args.seq_len)[:64].split(16):
            x, y = batch(ids, s)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
        model.train()
        return sum(losses) / len(losses)

    held_qa = sft.examples(tok, test_pairs[:256], args.seq_len, args.seed)

    @torch.no_grad()
    def answer_loss() -> float:
        """Loss on the answers of held-out question-answer pairs, given their questions."""
        model.eval()
        losses = []
        for i in range(0, len(held_qa), 16):
            x, y = sft.batch(held_qa[i:i + 16], pad_id)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(),
                                                            ignore_index=sft.IGNORE).item())
        model.train()
        return sum(losses) / max(len(losses), 1)

    start = time.time()
    if pretraining is None:
        history = pretrain(model, args, train_ids, batch, heldout_loss, gen, n_windows)
        pretrain_minutes = (time.time() - start) / 60
    else:
        history, pretrain_minutes = pretraining["history"], pretraining["minutes"]
        # the instruction stage draws its corpus windows from where pretraining left the generator
        gen.set_state(torch.tensor(pretraining["generator"], dtype=torch.uint8))
    start = time.time()
    if args.keep_pretrained:
        keep = Path(args.keep_pretrained)
        model.save_pretrained(keep)
        fast.save_pretrained(keep)
        (keep / "pretraining.json").write_text(json.dumps(
            {"args": {k: getattr(args, k) for k in PRETRAINING_ARGS}, "minutes": pretrain_minutes,
             "generator": gen.get_state().tolist(), "history": history}))
    pretrained = {"heldout_perplexity": math.exp(history["heldout_loss"][-1]),
                  "heldout_answer_perplexity": math.exp(answer_loss()) if held_qa else None}
    if args.sft_steps:
        def prose_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return batch(train_ids, torch.randint(0, n_windows, (n,), generator=gen) * args.seq_len)

        instruction_tune(model, tok, train_pairs, args, history, answer_loss, prose_batch)
    model.to(torch.bfloat16).save_pretrained(out)
    elapsed = time.time() - start
    final_loss = heldout_loss()
    metrics = {"parameters": num_params, "train_tokens": len(train_ids), "heldout_tokens": len(test_ids),
               "qa_pairs": len(train_pairs), "heldout_qa_pairs": len(test_pairs),
               "tokens_seen": args.steps * args.batch_size * args.seq_len, "minutes": pretrain_minutes + elapsed / 60,
               "final_heldout_loss": final_loss, "final_heldout_perplexity": math.exp(final_loss),
               "final_heldout_answer_perplexity": math.exp(answer_loss()) if held_qa else None,
               "before_instruction_tuning": pretrained}
    texts = {"heldout.txt": (out / "heldout.txt").read_text()}
    if old_heldout is not None:
        texts[f"compared: {compare}"] = old_heldout
    metrics["served"], samples = evaluate_served(out, texts)
    (out / "training_args.json").write_text(json.dumps({**vars(args), **metrics}, indent=2))
    plot(history, out / "loss.png")
    (out / "samples.json").write_text(json.dumps(samples, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))


def pretrain(model, args, train_ids, batch, heldout_loss, gen, n_windows: int) -> dict:
    """The language-model stage: AdamW with warmup and a cosine to a tenth, over windows of the
    corpus in a seeded order; returns the loss history."""
    import torch
    from tqdm import tqdm

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    start = time.time()
    history = {"step": [], "train_loss": [], "eval_step": [], "heldout_loss": []}
    order = torch.randperm(n_windows, generator=gen)
    pos = 0
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
    return history


def instruction_tune(model, tok, pairs, args, history: dict, answer_loss, prose_batch) -> None:
    """Steps over batches of question-answer exchanges, the loss on the answers only, at a lower
    learning rate decaying to zero. Each step also takes the plain language-model loss of
    --sft-prose-batch windows of the corpus (prose_batch(n) gives them): without it, 250 steps
    at 5e-4 took the held-out perplexity from 38.9 to 96.7 (vocab 8192) while teaching the answers'
    form."""
    import torch
    from tqdm import tqdm

    data = sft.examples(tok, pairs, args.seq_len, args.seed)
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    pad_id = tok.token_to_id("<|endoftext|>")
    bar = tqdm(range(args.sft_steps), desc="instruction tuning", unit="step")
    for step in bar:
        x, y = sft.batch(rng.sample(data, min(args.sft_batch_size, len(data))), pad_id)
        for group in opt.param_groups:
            group["lr"] = args.sft_lr * 0.5 * (1 + math.cos(math.pi * step / args.sft_steps))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x).logits
        answers = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=sft.IGNORE)
        loss = answers
        if args.sft_prose_batch:
            px, py = prose_batch(args.sft_prose_batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                prose_logits = model(px).logits
            prose = torch.nn.functional.cross_entropy(prose_logits.float().flatten(0, 1), py.flatten())
            loss = loss + prose
            history.setdefault("sft_prose_loss", []).append(prose.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        history.setdefault("sft_step", []).append(args.steps + step)
        history.setdefault("sft_loss", []).append(answers.item())
    history["answer_loss_after_sft"] = answer_loss()


SAMPLE_QUESTIONS = ("What is a list comprehension?", "How do I read a file line by line?",
                    "What does the json module do?", "What is a dictionary?", "How do I catch an exception?")
EVAL_CHARS = 100_000  # of each held-out text, for the served model's perplexity


def evaluate_served(model_dir: Path, texts: dict[str, str]) -> tuple[dict, list[dict]]:
    """The saved model as dabba serves it: perplexity and bits per byte on each text (bits per
    byte compare models whose tokenizers differ), and greedy answers to SAMPLE_QUESTIONS."""
    from dabba import LLM, SamplingParams
    from dabba.tools.evaluation import perplexity

    llm = LLM(str(model_dir))
    report = {}
    for name, text in texts.items():
        result = perplexity(llm, text[:EVAL_CHARS])
        report[name] = {"perplexity": result.perplexity, "bits_per_byte": result.bits_per_byte,
                        "num_tokens": result.num_tokens}
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in SAMPLE_QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)
    return report, [{"question": q, "answer": o.outputs[0].text} for q, o in zip(SAMPLE_QUESTIONS, outs)]


def plot(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["train_loss"], lw=0.6, alpha=0.6, label="train (per step)")
    ax.plot(history["eval_step"], history["heldout_loss"], "o-", label="held-out")
    if history.get("sft_step"):
        ax.plot(history["sft_step"], history["sft_loss"], lw=0.6, alpha=0.6, label="instruction tuning: answers")
    if history.get("sft_prose_loss"):
        ax.plot(history["sft_step"], history["sft_prose_loss"], lw=0.6, alpha=0.6,
                label="instruction tuning: corpus windows")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("dabba demo model")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
