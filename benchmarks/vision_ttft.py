"""Time to first token for one image and a short text, dabba against transformers on the same
checkpoint and threads: a random Gemma-3-4B-shaped checkpoint (SigLIP so400m at 896 x 896, 256
tokens an image; the 4B language model) or a Qwen2.5-VL-3B-shaped one (its windowed tower: an
896 x 896 image is 4096 patches, 1024 tokens), each engine in its own process, one after the other.

    .venv/bin/python -m benchmarks.vision_ttft --make-model /tmp/vl/gemma3-4b [--shape qwen2.5-vl-3b]
    .venv/bin/python -m benchmarks.vision_ttft --model /tmp/vl/gemma3-4b [--runs 3 --text-tokens 64]

A request: one 896 x 896 image and ``--text-tokens`` tokens of text, the prompt as the model's
processor writes it, max_tokens 1 (dabba: LLM.generate; transformers: the processor, then
generate(max_new_tokens=1); for Qwen2.5-VL its image processor and the pads grown as its
processor grows them, its whole processor wanting torchvision for videos). Each run shows a new
image (no encoder or prefix cache hit); the first run of each engine warms it up and is not
counted. --shape tiny / qwen-tiny make small checkpoints (the tests run the script on them).

Prints one JSON object: each engine's TTFTs (seconds), their medians and the median time of the
image's encoding (vision tower and projector) within them, and dabba's / transformers' TTFT.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # google/gemma-3-4b-it's sizes (config.json and Gemma3TextConfig's defaults)
    "gemma3-4b": dict(text=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262_208,
                                sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                query_pre_attn_scalar=256),
                      vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                  num_attention_heads=16, image_size=896, patch_size=14),
                      tokens_per_image=256, dtype="bfloat16"),
    # Qwen/Qwen2.5-VL-3B-Instruct's sizes (its config.json)
    "qwen2.5-vl-3b": dict(text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                    num_attention_heads=16, num_key_value_heads=2, vocab_size=151_936,
                                    max_window_layers=70, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                           "mrope_section": [16, 24, 24]}),
                          vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                      out_hidden_size=2048, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
                          tie_word_embeddings=True, dtype="bfloat16"),
    "qwen-tiny": dict(text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=2048,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
                      vision=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                                  window_size=56, fullatt_block_indexes=[1]),
                      tie_word_embeddings=False, dtype="float32"),
    "tiny": dict(text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, vocab_size=2048, sliding_window=16),
                 vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             image_size=56, patch_size=14),
                 tokens_per_image=4, dtype="float32"),
}


QWEN_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_SIZE = 896  # Qwen2.5-VL's images (Gemma 3's: its tower's image_size)


def make_model(out: Path, shape: str) -> None:
    """A random checkpoint of ``shape`` with its processor: the byte-level tokenizer of
    tools/tiny_checkpoint with the family's image tokens (the embedding has the shape's whole
    vocabulary)."""
    import torch
    import transformers

    from tools.tiny_checkpoint import tokenizer_with_specials

    s = SHAPES[shape]
    if shape.startswith("qwen"):
        make_qwen_model(out, s)
        return
    tok = tokenizer_with_specials(("<start_of_image>", "<image_soft_token>", "<end_of_image>"))
    boi, image, eoi = (tok.token_to_id(t) for t in ("<start_of_image>", "<image_soft_token>", "<end_of_image>"))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                              "eoi_token": "<end_of_image>"})
    text = transformers.Gemma3TextConfig(**s["text"], max_position_embeddings=4096)
    vision = transformers.SiglipVisionConfig(**s["vision"])
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=s["tokens_per_image"],
                                       image_token_index=image, boi_token_index=boi, eoi_token_index=eoi,
                                       bos_token_id=0, eos_token_id=1, pad_token_id=2)
    dtype = getattr(torch, s["dtype"])
    torch.set_default_dtype(dtype)  # built in its dtype: a 4B model never exists in float32
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(std=0.02)
    model.save_pretrained(out)
    size = s["vision"]["image_size"]
    processor = transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size})
    transformers.Gemma3Processor(image_processor=processor, tokenizer=tokenizer,
                                 image_seq_length=s["tokens_per_image"]).save_pretrained(out)


def make_qwen_model(out: Path, s: dict[str, Any]) -> None:
    import torch
    import transformers

    from tools.tiny_checkpoint import tokenizer_with_specials

    tok = tokenizer_with_specials(QWEN_SPECIALS)
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIALS}
    config = transformers.Qwen2_5_VLConfig(
        text_config={**s["text"], "bos_token_id": 0, "eos_token_id": 1, "max_position_embeddings": 4096},
        vision_config=s["vision"], image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=s["tie_word_embeddings"], bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.set_default_dtype(getattr(torch, s["dtype"]))
    torch.manual_seed(0)
    transformers.Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(out)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         pad_token="<pad>").save_pretrained(out)
    transformers.Qwen2VLImageProcessorPil().save_pretrained(out)


def qwen_inputs(prompt: str, image: Any, tokenizer: Any, image_processor: Any) -> dict[str, Any]:
    """What Qwen2_5_VLProcessor makes of a prompt and its image."""
    import torch

    inputs = dict(image_processor(images=[image], return_tensors="pt"))
    count = int(inputs["image_grid_thw"][0].prod()) // image_processor.merge_size ** 2
    ids = torch.tensor([tokenizer.encode(prompt.replace("<|image_pad|>", "<|image_pad|>" * count))])
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == pad).int()}


def workload(model: str, run: int, text_tokens: int) -> tuple[str, Any]:
    """Run ``run``'s prompt (<start_of_image>, then the text of ``text_tokens`` random tokens of
    the tokenizer's own vocabulary, which reads back as about as many) and its image."""
    import numpy as np
    from PIL import Image
    from tokenizers import Tokenizer

    qwen = _is_qwen(model)
    size = IMAGE_SIZE if qwen else json.loads((Path(model) / "config.json").read_text())["vision_config"]["image_size"]
    rng = np.random.default_rng(run)
    text = Tokenizer.from_file(str(Path(model) / "tokenizer.json")).decode(rng.integers(3, 1000, text_tokens).tolist())
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    return f"{QWEN_IMAGE if qwen else '<start_of_image>'} {text}", image


def _is_qwen(model: str) -> bool:
    return json.loads((Path(model) / "config.json").read_text())["model_type"] == "qwen2_5_vl"


def run_engine(engine: str, model: str, runs: int, text_tokens: int, threads: int,
               dabba_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """In this process: ``runs`` + 1 requests on ``engine``, the first not counted (``dabba_kwargs``:
    the LLM's, for dabba)."""
    import torch

    torch.set_num_threads(threads)
    times, encoder, prompt_tokens = [], [], 0

    def timed(fn: Any) -> Any:
        """``fn``, its time added to the run's encoder time."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                encoder[-1] += time.perf_counter() - start
        return wrapper

    if engine == "dabba":
        from dabba import LLM, SamplingParams

        llm = LLM(model, max_num_batched_tokens=2048, **(dabba_kwargs or {}))
        images = llm.llm_engine.engine_core.model_runner.images
        images.update = timed(images.update)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for run in range(runs + 1):
            prompt, image = workload(model, run, text_tokens)
            encoder.append(0.0)
            start = time.perf_counter()
            (out,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
            prompt_tokens = len(out.prompt_token_ids)
    else:
        import transformers

        qwen = _is_qwen(model)
        if qwen:
            tokenizer = transformers.AutoTokenizer.from_pretrained(model)
            image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model)
            hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(model, dtype="auto").eval()
            tower, last = hf.model.visual, hf.model.visual  # (the merger is inside the tower)
        else:
            processor = transformers.AutoProcessor.from_pretrained(model)
            hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(model, dtype="auto").eval()
            tower, last = hf.model.vision_tower, hf.model.multi_modal_projector
        began: list[float] = []  # the tower's start, until the projector ends the encoding
        tower.register_forward_pre_hook(lambda *_: began.append(time.perf_counter()))
        last.register_forward_hook(lambda *_: encoder.__setitem__(-1, encoder[-1] + time.perf_counter() - began.pop()))
        for run in range(runs + 1):
            prompt, image = workload(model, run, text_tokens)
            encoder.append(0.0)
            start = time.perf_counter()
            inputs = (qwen_inputs(prompt, image, tokenizer, image_processor) if qwen else
                      processor(text=prompt, images=image, return_tensors="pt"))
            inputs["pixel_values"] = inputs["pixel_values"].to(hf.dtype)
            with torch.no_grad():
                hf.generate(**inputs, max_new_tokens=1, do_sample=False)
            times.append(time.perf_counter() - start)
            prompt_tokens = inputs["input_ids"].shape[1]
    return {"ttft_s": [round(t, 3) for t in times[1:]], "warmup_s": round(times[0], 3),
            "median_s": round(statistics.median(times[1:]), 3), "prompt_tokens": prompt_tokens,
            "encoder_median_s": round(statistics.median(encoder[1:]), 3)}  # the image's encoding, of the TTFT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint --make-model wrote")
    parser.add_argument("--make-model", help="write a random checkpoint of --shape here, then stop")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-4b")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--engines", default="dabba,transformers")
    parser.add_argument("--dabba-kwargs", default="{}",
                        help='dabba\'s LLM arguments as JSON, e.g. {"quantization": "w8a8", "vision_quantization": "w8a8"}')
    parser.add_argument("--one-engine", help=argparse.SUPPRESS)  # the child process's
    args = parser.parse_args()
    if args.make_model:
        make_model(Path(args.make_model), args.shape)
        return
    if args.one_engine:
        print(json.dumps(run_engine(args.one_engine, args.model, args.runs, args.text_tokens, args.threads,
                                    json.loads(args.dabba_kwargs))))
        return
    result: dict[str, Any] = {"model": args.model, "runs": args.runs, "text_tokens": args.text_tokens,
                              "threads": args.threads, "cpu": _cpu_name(), "dabba_kwargs": json.loads(args.dabba_kwargs)}
    for engine in args.engines.split(","):  # one process each: both never hold the weights at once
        child = subprocess.run([sys.executable, "-m", "benchmarks.vision_ttft", "--one-engine", engine,
                                "--model", args.model, "--runs", str(args.runs), "--text-tokens",
                                str(args.text_tokens), "--threads", str(args.threads), "--dabba-kwargs",
                                args.dabba_kwargs],
                               capture_output=True, text=True, check=False)
        if child.returncode != 0:
            raise SystemExit(f"{engine} failed:\n{child.stderr[-4000:]}")
        result[engine] = json.loads(child.stdout.strip().splitlines()[-1])
    if "dabba" in result and "transformers" in result:
        result["ttft_ratio"] = round(result["dabba"]["median_s"] / result["transformers"]["median_s"], 3)
    print(json.dumps(result))


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
