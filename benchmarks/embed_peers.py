"""Embedding throughput side by side: dabba (`dabba bench embed`'s measurement) against
sentence-transformers on the same checkpoint, and llama.cpp (llama-cpp-python's embed(), the
loop llama-server's /embedding runs) on the checkpoint converted to GGUF by llama.cpp's own
converter, the same texts and the same threads, each in a process of its own, in turn, on random
checkpoints of real embedding models' shapes.

    .venv/bin/python -m benchmarks.embed_peers --make-shapes /tmp/embed-shapes
    .venv/bin/python -m benchmarks.embed_peers --model /tmp/embed-shapes/bge-base \\
        [--num-prompts 512 --input-len 256 --batch-size 32 --threads 2 --repeats 2 --dtype float32]
        [--llamacpp-python .venv-llamacpp/bin/python --llama-cpp-dir .peers/llama.cpp]

Prints one JSON object: each run's documents/s and tokens/s, and the ratios of the medians.
sentence-transformers encodes in batches of --batch-size (its own default is 32); dabba takes
every input at once (its scheduler batches them under its token budget); llama.cpp fills
batches of --llamacpp-batch tokens (its context, batch and micro-batch; 512 is llama-server's
micro-batch and llama.cpp's fastest here: a batch's tokens attend over the whole batch's cache,
so 2048 and 4096 ran slower), in the GGUF type of --dtype (bf16 or f32). llama.cpp runs where
its venv is given and the shape converts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Real configs' numbers, random weights (the figures measure the engines, not the models).
SHAPES = {
    "bge-base": dict(arch="BertModel", pooling="CLS", config=dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        max_position_embeddings=512, type_vocab_size=2, vocab_size=30522)),
    "qwen3-embedding-0.6b": dict(arch="Qwen3ForCausalLM", pooling="LAST", config=dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, vocab_size=151669,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}

PEER_SCRIPT = """
import json, sys, time, torch
torch.set_num_threads({threads})
from sentence_transformers import SentenceTransformer
texts = json.load(open({texts!r}))
model = SentenceTransformer({model!r}, device="cpu", model_kwargs={{"dtype": getattr(torch, {dtype!r})}})
model.encode(texts[:4], batch_size={batch})
start = time.perf_counter()
vectors = model.encode(texts, batch_size={batch})
elapsed = time.perf_counter() - start
tokens = sum(len(model.tokenizer(t)["input_ids"]) for t in texts)
print(json.dumps({{"elapsed_s": elapsed, "documents_per_s": len(texts) / elapsed, "tokens_per_s": tokens / elapsed}}))
"""

DABBA_SCRIPT = """
import json, torch
torch.set_num_threads({threads})
from dabba.tools.bench.embed import EmbedWorkload, bench_embed
print(json.dumps(bench_embed({model!r}, EmbedWorkload({num}, {length}), dtype={dtype!r}, **{options!r})))
"""


LLAMACPP_SCRIPT = """
import json, time
from llama_cpp import Llama
texts = json.load(open({texts!r}))
llm = Llama(model_path={gguf!r}, embedding=True, n_threads={threads}, n_threads_batch={threads}, n_ctx={batch},
            n_batch={batch}, n_ubatch={batch}, verbose=False)
llm.embed(texts[:4])
start = time.perf_counter()
vectors = llm.embed(texts)
elapsed = time.perf_counter() - start
tokens = sum(len(llm.tokenize(t.encode(), add_bos=True, special=False)) for t in texts)
print(json.dumps({{"elapsed_s": elapsed, "documents_per_s": len(texts) / elapsed, "tokens_per_s": tokens / elapsed,
                  "dimensions": len(vectors[0])}}))
"""


def convert_gguf(model: Path, llamacpp_python: str, llama_cpp_dir: str, gguf_type: str) -> Path:
    """The checkpoint converted by llama.cpp's converter (benchmarks/peers/make_gguf.py), once."""
    out_dir = model / "gguf"
    path = out_dir / f"model-{gguf_type}.gguf"
    if not path.is_file():
        script = Path(__file__).resolve().parent / "peers" / "make_gguf.py"
        subprocess.run([llamacpp_python, str(script), "--model", str(model), "--llama-cpp-dir", llama_cpp_dir,
                        "--out-dir", str(out_dir), "--types", gguf_type, "--convert-python", sys.executable],
                       check=True, stdout=subprocess.DEVNULL)
    return path


def make_shapes(out: Path) -> dict[str, str]:
    from tools.embedding_checkpoints import embedding_checkpoint, encoder_checkpoint

    made = {}
    for name, shape in SHAPES.items():
        path = out / name
        if not (path / "config.json").is_file():
            if shape["arch"] == "BertModel":
                encoder_checkpoint(path, shape["arch"], shape["pooling"], initializer_range=0.02, tokenizer="wordpiece",
                                   **shape["config"])
            else:
                embedding_checkpoint(path, shape["arch"], shape["pooling"], dtype="bfloat16",
                                     tokenizer_vocab_size=4096, **shape["config"])
        made[name] = str(path)
    return made


def run(python: str, code: str) -> dict:
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"a run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-shapes", metavar="OUT", help="write the shapes' checkpoints under OUT and exit")
    parser.add_argument("--model")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--llamacpp-python", help="llama-cpp-python's venv's Python (scripts/peer-llamacpp.sh "
                                                  "builds .venv-llamacpp); without it llama.cpp does not run")
    parser.add_argument("--llama-cpp-dir", default=".peers/llama.cpp", help="llama.cpp's source tree (its converter)")
    parser.add_argument("--llamacpp-batch", type=int, default=512)
    parser.add_argument("--quantization", choices=["int8", "w8a8"],
                        help="dabba's linears quantized at load (the peers stay in --dtype)")
    args = parser.parse_args()
    if args.make_shapes:
        print(json.dumps(make_shapes(Path(args.make_shapes)), indent=2))
        return
    from dabba.engine.tokenizer import Tokenizer
    from dabba.tools.bench.embed import EmbedWorkload, make_texts

    config = json.loads((Path(args.model) / "config.json").read_text())
    texts = make_texts(EmbedWorkload(args.num_prompts, args.input_len), Tokenizer(args.model), config["vocab_size"])
    texts_file = Path(f"/tmp/embed-peers-{int(time.time())}.json")
    texts_file.write_text(json.dumps(texts))
    scripts = {
        "dabba": (sys.executable, DABBA_SCRIPT.format(threads=args.threads, model=args.model, num=args.num_prompts,
                                                      length=args.input_len, dtype=args.dtype,
                                                      options={"quantization": args.quantization} if args.quantization
                                                      else {})),
        "sentence_transformers": (sys.executable, PEER_SCRIPT.format(
            threads=args.threads, texts=str(texts_file), model=args.model, dtype=args.dtype, batch=args.batch_size))}
    if args.llamacpp_python:
        gguf = convert_gguf(Path(args.model), args.llamacpp_python, args.llama_cpp_dir,
                            "bf16" if args.dtype == "bfloat16" else "f32")
        scripts["llama_cpp"] = (args.llamacpp_python, LLAMACPP_SCRIPT.format(
            texts=str(texts_file), gguf=str(gguf), threads=args.threads, batch=args.llamacpp_batch))
    runs: dict[str, list[dict]] = {who: [] for who in scripts}
    for r in range(args.repeats):
        order = list(scripts)[r % len(scripts):] + list(scripts)[:r % len(scripts)]
        for who in order:
            runs[who].append(run(*scripts[who]))
    medians = {who: statistics.median(r["documents_per_s"] for r in rs) for who, rs in runs.items()}
    print(json.dumps({"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
                      "threads": args.threads, "dtype": args.dtype, "dabba_quantization": args.quantization,
                      "st_batch_size": args.batch_size,
                      "llamacpp_batch": args.llamacpp_batch if args.llamacpp_python else None,
                      "runs": runs, "median_documents_per_s": medians,
                      **{f"ratio_dabba_to_{who}": medians["dabba"] / m for who, m in medians.items() if who != "dabba"}},
                     indent=2))


if __name__ == "__main__":
    main()
