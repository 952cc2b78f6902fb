"""Speculative decoding: proposers of draft tokens (ngram.py). Verification happens in the model
runner's ordinary forward and sampler (dabba/worker/model_runner.py); the scheduler schedules each
request's drafts with its next token and rolls back what was rejected (dabba/core/scheduler.py)."""
