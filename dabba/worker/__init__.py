"""Everything that owns tensors: the model, the KV cache, input preparation, sampling."""
