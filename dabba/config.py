"""User-facing configuration: one frozen dataclass per concern, combined into EngineConfig.

Every field carries its help text in ``metadata["help"]`` (the CLI builds its flags from it).
Values derived at run time (the number of KV blocks) live in ``CacheLayout``, never here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from dabba.config_fields import _help, json_object, parse_bytes

DTYPES = ("auto", "bfloat16", "float16", "float32")
NATIVE_LAYER_LOOP = ("auto", "on", "off")
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")  # how embeddings pool (arch/pooling_config.py)
DEFAULT_IMAGES_PER_PROMPT = 8  # limit_mm_per_prompt's default

# The small model dabba trains itself (tools/train_demo_model.py), shipped in the package: the
# default MODEL of `dabba serve`, `generate` and `chat`.
DEMO_MODEL = str(Path(__file__).resolve().parent / "assets" / "demo")


@dataclass(frozen=True)
class ModelConfig:
    model: str = _help("A Hugging Face model directory (config.json, *.safetensors, tokenizer.json), a GGUF file "
                       "(llama.cpp's), or a Hub repo id (owner/name; owner/name:Q4_K_M for one of its GGUF files), "
                       "downloaded into the Hugging Face cache (or download_dir) on first use.")
    revision: str | None = _help("The Hub revision (branch, tag or commit) of a model given as a repo id; default: main.",
                                 None)
    tokenizer: str | None = _help("The tokenizer's directory or Hub repo id, where it is not the model's.", None)
    chat_template: str | None = _help("A chat template in place of the checkpoint's: a file's path, or the "
                                      "template's text (Jinja, as Hugging Face writes them).", None)
    hf_overrides: dict[str, Any] | None = _help(
        'Fields laid over the checkpoint\'s config.json, as a JSON object (vLLM\'s flag). Qwen3-Reranker as '
        'released, served as a reranker: {"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true} (its score: the "yes" '
        'token\'s probability against "no" at the last token of its judging prompt).', None, parse=json_object)
    gguf_file: str | None = _help(
        "The GGUF file to serve from the Hub repo given as the model (its path in the repo); the model's :TAG "
        "(llama.cpp's owner/repo:Q4_K_M) picks one by its quantization too.", None)
    download_dir: str | None = _help("Where Hub downloads go (and are looked for); default: the Hugging Face cache "
                                     "(HF_HOME, HF_HUB_CACHE).", None)
    dtype: str = _help('Weights and activations dtype: "auto" (from config.json), "bfloat16", "float16", "float32".', "auto")
    max_model_len: int | None = _help("Longest sequence (prompt + output) in tokens; default: the model's limit.", None)
    device: str = _help('"auto" (CUDA if available, else CPU), "cpu" or "cuda".', "auto")
    seed: int = _help("Seed for requests that sample without a seed of their own.", 0)
    quantization: str | None = _help('Weight quantization at load time: "int8" (per channel) or "int4" (groups of 128; 64 or 32 where 128 does not tile a layer), round to nearest; "w8a8": int8 weights times activations rounded to int8 per token at run time (integer GEMMs).', None)
    attention_backend: str = _help('"auto" (native CPU kernels on CPU, else the reference), "torch_ref" or "cpu".', "auto")
    runner: str = _help(
        '"auto": a pooler (embeddings only, no LM head) where the checkpoint is one (a base *Model, or '
        'sentence-transformers files), else a generator, which embeds too; "generate" or "pooling" to say.', "auto")
    pooling_type: str | None = _help(
        'How embeddings pool the hidden states: "LAST", "MEAN" or "CLS"; default: the checkpoint\'s '
        'sentence-transformers Pooling module, else the family\'s convention (LAST for decoders).', None)
    native_layer_loop: str = _help(
        '"auto": run every step\'s layers in the native C++ loop (csrc/decode_cpu.cpp) where it computes exactly '
        'what the Python layers do (CPU attention backend, a family and linear layers with a native form), '
        'else the Python layers; "on": the loop, or an error saying why not; "off": the Python layers, the '
        'reference (forward hooks and changes to a layer\'s forward take effect only there).', "auto")
    vision_quantization: str | None = _help(
        '"w8a8": a vision-language model\'s image encoder runs its linears in W8A8 too (int8 weights times '
        'activations rounded to int8 per token); by default it keeps the model\'s dtype whatever --quantization '
        'says.', None)
    limit_mm_per_prompt: dict[str, int] | None = _help(
        f'Most images one prompt may carry, as JSON (vLLM\'s form): {{"image": N}}; default '
        f'{{"image": {DEFAULT_IMAGES_PER_PROMPT}}}.', None, parse=json_object)

    @property
    def max_images_per_prompt(self) -> int:
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT)

    def __post_init__(self) -> None:
        if isinstance(self.hf_overrides, str):
            object.__setattr__(self, "hf_overrides", json_object(self.hf_overrides, "hf_overrides"))
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object, got {type(self.hf_overrides).__name__}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f'device must be "auto", "cpu" or "cuda[:N]", got {self.device!r}')
        if self.quantization not in (None, "int8", "int4", "w8a8"):
            raise ValueError(f'quantization must be "int8", "int4", "w8a8" or None, got {self.quantization!r}')
        if self.vision_quantization not in (None, "w8a8"):
            raise ValueError(f'vision_quantization must be "w8a8" or None, got {self.vision_quantization!r}')
        if self.attention_backend not in ("auto", "torch_ref", "cpu"):
            raise ValueError(f'attention_backend must be "auto", "torch_ref" or "cpu", got {self.attention_backend!r}')
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.pooling_type is not None and self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        if isinstance(self.limit_mm_per_prompt, str):
            object.__setattr__(self, "limit_mm_per_prompt", json_object(self.limit_mm_per_prompt,
                                                                        "limit_mm_per_prompt"))
        limits = self.limit_mm_per_prompt
        if limits is not None and (not isinstance(limits, dict) or set(limits) - {"image"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in limits.values())):
            raise ValueError(f'limit_mm_per_prompt must be {{"image": N}} with N >= 0, got {limits!r}')
        if self.native_layer_loop not in NATIVE_LAYER_LOOP:
            raise ValueError(f"native_layer_loop must be one of {NATIVE_LAYER_LOOP}, got {self.native_layer_loop!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _help("Tokens per KV-cache block.", 16)
    kv_cache_memory: int | None = _help(
        "Bytes for the KV cache; default: 30% of free RAM up to 4 GiB (80% of free GPU memory), "
        "capped at what max_num_seqs full-length sequences need. Accepts sizes such as 4GiB.", None, parse=parse_bytes)
    enable_prefix_caching: bool = _help("Share KV blocks of equal prompt prefixes between requests.", True)
    kv_cache_dtype: str = _help('KV-cache element type: "auto" (the model\'s dtype), "int8" or "fp8" (float8_e4m3fn), '
                                'both with a scale per token and KV head.', "auto")

    kv_offload_memory: int | None = _help(
        "Bytes of host memory under the KV pool that keep the prefix blocks the pool evicts (least recently used "
        "first out), so a prompt that misses the pool loads them back instead of recomputing them. Default: none. "
        "Accepts sizes such as 8GiB.", None, parse=parse_bytes)
    kv_offload_dir: str | None = _help(
        "A directory for a disk tier under the host-memory one (needs kv_offload_memory): blocks it lets go are "
        "written there, one file each, under the model's key, and read back for later prompts and restarts.", None)
    kv_offload_disk_size: int = _help("Bytes of KV blocks the disk tier keeps. Accepts sizes such as 64GiB.",
                                      16 * 2**30, parse=parse_bytes)
    encoder_cache_memory: int = _help(
        "Bytes for the image embeddings kept by content hash (the encoder cache): an image shown again, in a "
        "later turn or another request, is not encoded again while its embeddings are here. Accepts sizes such "
        "as 256MiB.", 256 * 2**20, parse=parse_bytes)

    def __post_init__(self) -> None:
        if self.encoder_cache_memory <= 0:
            raise ValueError(f"encoder_cache_memory must be a positive number of bytes, got "
                             f"{self.encoder_cache_memory}")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(f'kv_cache_dtype must be "auto", "int8" or "fp8", got {self.kv_cache_dtype!r}')
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        for name in ("kv_cache_memory", "kv_offload_memory", "kv_offload_disk_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive number of bytes, got {getattr(self, name)}")
        if self.kv_offload_dir is not None and self.kv_offload_memory is None:
            raise ValueError("kv_offload_dir needs kv_offload_memory: blocks reach the disk through host memory")


SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding as vLLM spells it: each step a request may carry up to
    ``num_speculative_tokens`` proposed tokens, verified in the same forward as its next token.
    "ngram": the proposal is what followed the most recent earlier occurrence of the request's
    last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt and output.
    "draft_model" (the method when ``model`` is given): a small model with the target's tokenizer
    proposes, run by the same engine on its own KV cache."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model: a directory or a Hub repo id
    # Each step, a request proposes only the drafts expected to pay for the time they add, from
    # measured step times and its acceptance so far (core/spec_budget.py); False: always k, a
    # schedule that does not depend on timing (a seeded draft-model request then samples the same
    # text in every run).
    adaptive_drafts: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; supported: {SPEC_METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.adaptive_drafts, bool):
            raise ValueError(f"speculative_config: adaptive_drafts must be true or false, got {self.adaptive_drafts!r}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative_config: prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({self.prompt_lookup_min})")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError('speculative_config: method "draft_model" needs "model", the draft model\'s directory '
                             "or Hub repo id")
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative_config: "model" is for method "draft_model", not "ngram"')

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs beyond its scheduled tokens: a draft model writes its own KV
        for the tokens it proposes from (n-gram proposals need none)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a dict (``LLM(speculative_config={...})``) or its JSON text (``--speculative-config``).
        A "model" without a "method" means "draft_model", as in vLLM."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json_object(value, "speculative_config")
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        value = dict(value)
        if "model" in value and "method" not in value:
            value["method"] = "draft_model"
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)


def speculative_config_json(text: str) -> dict[str, Any]:
    """--speculative-config's JSON, checked now and kept as a plain dict (benchmarks print their options)."""
    return dataclasses.asdict(SpeculativeConfig.parse(text))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _help("Most requests running in one step.", 256)
    max_num_batched_tokens: int = _help("Token budget of one step (prefill chunks + decodes).", 4096)
    speculative_config: SpeculativeConfig | None = _help(
        'Speculative decoding, as JSON (vLLM\'s form): {"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_min": a, "prompt_lookup_max": b}, or a draft model with the same tokenizer: '
        '{"model": DIR, "num_speculative_tokens": k}; "adaptive_drafts": false keeps k drafts a step whatever '
        'they cost. Lossless: outputs are what the model alone gives.',
        None, parse=speculative_config_json)
    pooling_decode_slowdown: float = _help(
        "While generation requests decode, pooling requests (embeddings, scores) take only the tokens that keep a "
        "step within this factor of the decodes' own step time (measured on the engine's steps), so that embedding "
        "traffic slows chat streams by that much at most; 0: no limit (they take the step budget as prompts do).",
        1.2)
    encoder_budget: int | None = _help(
        "Image tokens (embedding rows) whose encodings may start in one step; default: max_num_batched_tokens.",
        None)
    image_decode_slowdown: float = _help(
        "While generation requests decode, image requests take only the units of image encoding and the prompt "
        "tokens that keep a step within this factor of the decodes' own step time (measured on the engine's "
        "steps), so that an arriving image slows chat streams by that much at most and waits longer itself; 0: no "
        "limit (each image is encoded whole in the step that reaches it).", 1.5)

    @property
    def image_token_budget(self) -> int:
        return self.encoder_budget if self.encoder_budget is not None else self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.encoder_budget is not None and self.encoder_budget < 1:
            raise ValueError(f"encoder_budget must be >= 1, got {self.encoder_budget}")
        if self.image_decode_slowdown != 0 and not self.image_decode_slowdown > 1:
            raise ValueError(f"image_decode_slowdown must be 0 (no limit) or above 1, got {self.image_decode_slowdown}")
        if self.pooling_decode_slowdown != 0 and not self.pooling_decode_slowdown > 1:
            raise ValueError(f"pooling_decode_slowdown must be 0 (no limit) or above 1, got "
                             f"{self.pooling_decode_slowdown}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _help(
        "Ranks that split every layer (Megatron's tensor parallelism): attention heads, MLP channels and the "
        "vocabulary, summed over the ranks with torch.distributed (gloo on CPU, NCCL on CUDA). Each rank is a process "
        "with its share of the cores (or its own GPU) and a KV cache for its heads.", 1)
    distributed_executor_backend: str = _help(
        '"mp": the ranks are local processes; "ray": Ray actors, one placement-group bundle per rank, on the Ray '
        "cluster this process joins (ray.init(address=\"auto\"), else a local one).", "mp")
    data_parallel_size: int = _help(
        "Engine replicas behind one server (`dabba serve`), each with its own KV cache, scheduler and worker "
        "processes on its own share of the cores: a request goes to the replica that caches the longest prefix of "
        "it, else to the least loaded one.", 1)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")


MAX_LORA_RANK = 512


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = _help(
        "Serve PEFT LoRA adapters per request (LLM.generate's lora_request): each request's rows add its adapter's "
        "low-rank product to the base model's attention and MLP projections, in one batch with other adapters and "
        "the base model.", False)
    max_loras: int = _help(
        "Adapters resident at once: the requests of one step use at most this many; others wait, and a resident "
        "adapter no running request uses gives its place to the next one asked for (least recently used first).", 4)
    max_lora_rank: int = _help(f"Largest adapter rank taken (1 to {MAX_LORA_RANK}); a larger one is refused.", 16)

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be an integer in [1, {MAX_LORA_RANK}], got {self.max_lora_rank!r}")


@dataclass(frozen=True)
class EngineConfig:
    PARTS: ClassVar[dict[str, type]] = {"model_config": ModelConfig, "cache_config": CacheConfig,
                                        "scheduler_config": SchedulerConfig, "parallel_config": ParallelConfig,
                                        "lora_config": LoRAConfig}

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Split flat options among the parts; an unknown option is an error, never ignored."""
        parts = cls.PARTS
        known = {f.name: part for part, klass in parts.items() for f in dataclasses.fields(klass)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; known options: {sorted(known)}")
        grouped: dict[str, dict[str, Any]] = {part: {} for part in parts}
        for name, value in kwargs.items():
            grouped[known[name]][name] = value
        return cls(**{part: klass(**grouped[part]) for part, klass in parts.items()})


@dataclass(frozen=True)
class ServerConfig:
    """What one request to `dabba serve` may ask for, and how the server stops. Not part of
    EngineConfig: the engine serves the Python API too, where these bounds do not apply."""

    max_n: int = _help("Most samples (n) one request may ask for.", 128)
    max_stop_sequences: int = _help("Most stop strings in one request.", 16)
    max_stop_length: int = _help("Longest stop string, in characters.", 256)
    max_request_body_bytes: int = _help(
        "Largest request body (base64 images included); a larger one is refused (413) before it is read in full. "
        "Accepts sizes such as 4MiB.", 32 * 2**20, parse=parse_bytes)
    shutdown_timeout: float = _help(
        "Seconds that SIGTERM or SIGINT gives the requests in flight to finish; streams still running then end "
        "with an error event and [DONE], and the exit status is 3.", 30.0)
    max_constraint_bytes: int = _help(
        "Largest structured-output constraint (response_format's JSON schema, a regex, a grammar, the choices, the "
        "tools a tool_choice forces), in bytes of its JSON text. Accepts sizes such as 64KiB.", 64 * 2**10,
        parse=parse_bytes)
    max_constraint_enum_values: int = _help(
        "Most enum and const values in one JSON schema, or choices in one choice constraint.", 1000)
    max_constraint_regex_length: int = _help(
        "Longest regex constraint, or pattern in a JSON schema, in characters.", 4096)
    max_constraint_grammar_rules: int = _help("Most rules in one grammar constraint.", 1000)
    structured_outputs_compile_timeout: float = _help(
        "Seconds a request waits for its constraint to compile (queued and compiling); past them it is refused "
        "(400) and a compile that no request waits for any more is stopped.", 5.0)
    max_stored_responses: int = _help(
        "Most Responses API responses kept in memory (store: true) for GET /v1/responses/{id} and "
        "previous_response_id; storing one more evicts the least recently used.", 1000)
    max_connections: int = _help(
        "Most client connections open at once (each holds a file descriptor); one more is answered 503 and "
        "closed.", 2048)
    timeout_request_head: float = _help(
        "Seconds a client has to send a request's line and headers, counted from its connection or from the "
        "first byte after its previous response; a slower one is answered 408 and closed.", 10.0)
    allowed_media_domains: str | None = _help(
        "Hosts (comma-separated, exact names) whose http(s) image URLs requests may name; each is fetched within "
        "media_fetch_timeout, never following a redirect to another host. Default: none (images come as base64 "
        "data: URLs only).", None)
    media_fetch_timeout: float = _help("Seconds to fetch one image URL, in all.", 10.0)
    max_image_bytes: int = _help("Largest image, encoded. Accepts sizes such as 20MiB.", 20 * 2**20, parse=parse_bytes)
    max_image_pixels: int = _help("Most pixels (width x height) of one image; a larger one is refused from its "
                                  "header, before it is decoded.", 6000 * 6000)

    @property
    def media_domains(self) -> tuple[str, ...]:
        return tuple(d.strip().lower() for d in (self.allowed_media_domains or "").split(",") if d.strip())

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop_sequences", "max_stop_length", "max_request_body_bytes",
                     "max_constraint_bytes", "max_constraint_enum_values", "max_constraint_regex_length",
                     "max_constraint_grammar_rules", "max_connections", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.shutdown_timeout < float("inf"):
            raise ValueError(f"shutdown_timeout must be a number of seconds >= 0, got {self.shutdown_timeout}")
        for name in ("structured_outputs_compile_timeout", "timeout_request_head", "media_fetch_timeout"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0, got {getattr(self, name)}")
