"""How one request wants the model's hidden states pooled instead of tokens generated (vLLM's
PoolingParams): an embedding of its whole input, in one vector."""
from __future__ import annotations

from dataclasses import dataclass

from dabba.errors import InvalidRequest


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions``: keep the first N values (Matryoshka models only), before normalising;
    ``normalize``: L2-normalise the vector (None: as the model's pooler says);
    ``truncate_prompt_tokens``: keep only the input's last N tokens (-1: max_model_len), as vLLM
    does; without it an input longer than max_model_len is refused."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise InvalidRequest("dimensions", f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequest("normalize", f"normalize must be true, false or null, got {self.normalize!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise InvalidRequest("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or an integer >= 1, "
                                                           f"got {t!r}")
