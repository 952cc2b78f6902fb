"""The engine loop, tokenizer and detokenization."""
