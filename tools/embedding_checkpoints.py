"""Tiny random-weight retrieval checkpoints (no downloads): decoder embedding models as their
checkpoints save them (Qwen3-Embedding's layout, a base *Model), BERT-style encoders and
cross-encoders, with sentence-transformers' files saying how they pool. Built on tiny_checkpoint's
models and byte-level tokenizer; used by the embedding, scoring and bench tests and by
benchmarks/embed_peers.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.tiny_checkpoint import make_checkpoint, save_byte_level_tokenizer

ST_POOLING_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens",
                    "CLS": "pooling_mode_cls_token"}


def embedding_checkpoint(out_dir: str | Path, arch: str = "Qwen3ForCausalLM", pooling: str = "LAST",
                         normalize: bool = True, architecture: str | None = None, strip_prefix: bool = True,
                         prompts: dict[str, str] | None = None, default_prompt: str | None = None,
                         matryoshka: bool = False, sentence_transformers: bool = True, **options: Any) -> Path:
    """A tiny decoder saved as an embedding checkpoint: ``arch``'s random weights, its tensors as the
    base model saves them (no LM head; without the ``model.`` prefix if ``strip_prefix``, as
    Qwen3-Embedding's are), config.json naming ``architecture`` (default: ``arch``; "Qwen3Model"
    for a base model), and sentence-transformers' files (modules.json, 1_Pooling/config.json,
    2_Normalize if ``normalize``, config_sentence_transformers.json with ``prompts``)."""
    from safetensors.torch import load_file, save_file

    out_dir = make_checkpoint(out_dir, arch, **options)
    tensors = load_file(out_dir / "model.safetensors")
    tensors = {(k.removeprefix("model.") if strip_prefix else k): v for k, v in tensors.items()
               if not k.startswith("lm_head.")}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["architectures"] = [architecture or arch]
    config["tie_word_embeddings"] = True  # no head of its own stored
    if matryoshka:
        config["is_matryoshka"] = True
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if not sentence_transformers:
        return out_dir
    return write_sentence_transformers_files(out_dir, config["hidden_size"], pooling, normalize, prompts,
                                             default_prompt)


ENCODER_CONFIGS = {"Bert": "BertConfig", "XLMRoberta": "XLMRobertaConfig", "ModernBert": "ModernBertConfig"}


def save_wordpiece_tokenizer(out_dir: Path, vocab_size: int) -> int:
    """BERT's own kind of tokenizer (bge, e5, MiniLM): WordPiece over lower-cased text, [CLS] A [SEP]
    B [SEP] with token types 0 then 1, trained on the docstrings corpus; its vocabulary size."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from tools.tiny_checkpoint import training_corpus

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(training_corpus(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                                         show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                         sep_token="[SEP]", mask_token="[MASK]").save_pretrained(out_dir)
    return tok.get_vocab_size()


def encoder_checkpoint(out_dir: str | Path, arch: str = "BertModel", pooling: str | None = "CLS",
                       normalize: bool = True, num_labels: int = 1, seed: int = 0, tokenizer: str = "byte-level",
                       **overrides: Any) -> Path:
    """A tiny BERT-style encoder (``arch``: BertModel, XLMRobertaModel, or their
    ForSequenceClassification, a cross-encoder with ``num_labels`` outputs) with the byte-level
    tokenizer (its BOS as the first token, as BERT's [CLS] is; a pair's texts joined by <s>) or,
    ``tokenizer="wordpiece"``, BERT's own (save_wordpiece_tokenizer), and sentence-transformers'
    files for ``pooling`` (None: none)."""
    import torch
    import transformers
    from tokenizers import processors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    family = arch.removesuffix("Model").removesuffix("ForSequenceClassification")
    if tokenizer == "wordpiece":
        if family != "Bert":
            raise ValueError(f"a WordPiece tokenizer is BERT's, not {arch}'s")
        specials = dict(vocab_size=save_wordpiece_tokenizer(out_dir, 1024), pad_token_id=0)
    else:
        specials = dict(vocab_size=save_byte_level_tokenizer(out_dir, 1024, "docstrings"), pad_token_id=2,
                        bos_token_id=0, eos_token_id=1)
    params: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=130, initializer_range=0.1, **specials)
    if family == "ModernBert":  # three layers: one global, two local, with a window shorter than the tests' texts
        params.update(num_hidden_layers=3, local_attention=16)
    else:
        params["type_vocab_size"] = 2 if family == "Bert" else 1
    if arch.endswith("ForSequenceClassification"):
        params["num_labels"] = num_labels
    params.update(overrides)
    config = getattr(transformers, ENCODER_CONFIGS[family])(**params)
    config.architectures = [arch]
    torch.manual_seed(seed)
    auto = (transformers.AutoModelForSequenceClassification if arch.endswith("ForSequenceClassification")
            else transformers.AutoModel)
    auto.from_config(config).save_pretrained(out_dir)
    second = ":1" if getattr(config, "type_vocab_size", 1) > 1 else ""
    if tokenizer != "wordpiece":
        tokenizer_file = out_dir / "tokenizer.json"
        from tokenizers import Tokenizer
        # a pair as BERT writes it, <s> A </s> B </s> with types 0 then 1 (RoBERTa's: one type, all 0)
        tok = Tokenizer.from_file(str(tokenizer_file))
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair=f"<s> $A </s> $B{second} </s>{second}", special_tokens=[("<s>", 0), ("</s>", 1)])
        tok.save(str(tokenizer_file))
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"] + (["token_type_ids"] if second else [])
    # an encoder's has no chat template (sentence-transformers would format its pairs with one)
    tokenizer_config.pop("chat_template", None)
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if pooling is not None:
        write_sentence_transformers_files(out_dir, config.hidden_size, pooling, normalize)
    return out_dir


def write_sentence_transformers_files(out_dir: Path, hidden_size: int, pooling: str, normalize: bool,
                                      prompts: dict[str, str] | None = None, default_prompt: str | None = None) -> Path:
    """modules.json (Transformer, Pooling, Normalize if ``normalize``), the Pooling module's config
    for ``pooling`` (LAST, MEAN or CLS), config_sentence_transformers.json with ``prompts``."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out_dir / "2_Normalize").mkdir(exist_ok=True)
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {"word_embedding_dimension": hidden_size, "include_prompt": True,
                      **{mode: name == pooling for name, mode in ST_POOLING_MODES.items()}}
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    (out_dir / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts or {}, "default_prompt_name": default_prompt, "similarity_fn_name": "cosine"}, indent=2))
    return out_dir
