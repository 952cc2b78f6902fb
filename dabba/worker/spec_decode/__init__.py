"""Speculative decoding: proposers of draft tokens (ngram.py: lookup in the request's own tokens;
draft_model.py: a small model on its own KV cache). Verification happens in the model runner's
ordinary forward and sampler (dabba/worker/model_runner.py, worker/sampler.py); the scheduler
schedules each request's drafts with its next token, reserves a draft model's lookahead slots, and
rolls back what was rejected (dabba/core/scheduler.py)."""
