"""Which images a step encodes, and where a prompt chunk stops for them (vLLM v1's encoder budget).

A chunk that reaches an image's tokens needs the image's embeddings: they are in the encoder
cache already (an earlier chunk, request or turn encoded the same image), or the step encodes
the image whole. Encoding is rationed per step (``budget``, in embedding rows), so that a burst
of large images is spread over steps while decodes keep running, and bounded by the cache's room.
A chunk whose next image cannot be encoded this step stops before that image's tokens.

``whole_items``: the model's image tokens attend to each other both ways (Gemma 3), so a chunk
may not stop inside an image; every image token of a chunk sees the image's last token, whose key
must be in the cache by then. A chunk may start inside one (after a prefix-cache hit): the
cached part was computed with the whole image, which its blocks' hashes name.

    prompt:  | text | image 0 (encoded, cached) | text | image 1 (no room this step) | text |
    chunk:   start ...................................... end (cut to image 1's offset)
"""
from __future__ import annotations

from dabba.core.encoder_cache import EncoderCache
from dabba.core.outputs import SchedulerOutput
from dabba.core.request import Request
from dabba.errors import InvalidRequest


class EncoderScheduler:
    def __init__(self, budget: int, cache: EncoderCache, whole_items: bool, max_num_batched_tokens: int) -> None:
        self.budget = budget  # embedding rows the encoder may compute in one step
        self.cache = cache
        self.whole_items = whole_items
        self.max_num_batched_tokens = max_num_batched_tokens
        self.budget_left = budget
        self.num_encoded = 0  # images encoded since the start (LLM.get_stats, /metrics)

    def check(self, request: Request) -> None:
        """InvalidRequest if one of its images could never be encoded or computed."""
        for feature in request.mm_features:
            n = feature.position.length
            if n > self.budget:
                raise InvalidRequest("multi_modal_data", f"an image of {n} tokens exceeds the encoder budget of a "
                                                         f"step ({self.budget}); raise encoder_budget")
            if n > self.cache.capacity:
                raise InvalidRequest("multi_modal_data", f"an image of {n} tokens exceeds the encoder cache "
                                                         f"({self.cache.capacity} tokens); raise encoder_cache_memory")
            if self.whole_items and n > self.max_num_batched_tokens:
                raise InvalidRequest("multi_modal_data", f"an image of {n} tokens exceeds max_num_batched_tokens "
                                                         f"({self.max_num_batched_tokens}), and this model's image "
                                                         "tokens run in one step; raise max_num_batched_tokens")

    def begin_step(self) -> None:
        self.budget_left = self.budget

    def fit(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """How many of the ``num_new`` tokens from ``start`` can run this step, and the indices
        of the images (request.mm_features) to encode for them. Nothing is committed."""
        end = start + num_new
        encode: list[int] = []
        seen: set[str] = set()
        rows, room = 0, self.cache.num_free
        for i, feature in enumerate(request.mm_features):
            pos, identifier = feature.position, feature.identifier
            if pos.offset >= end:
                break
            if not pos.overlaps(start, end):
                continue
            if self.whole_items and pos.end > end:
                end = max(pos.offset, start)  # not into it; after a start inside it, not at all this step
                break
            if identifier in seen:
                continue
            seen.add(identifier)
            if identifier in self.cache:
                room -= self.cache.unreferenced.get(identifier, 0)  # pinned by this chunk: no longer room
                continue
            if rows + pos.length > min(self.budget_left, room):
                end = max(pos.offset, start)
                break
            encode.append(i)
            rows += pos.length
        return end - start, encode

    def schedule(self, out: SchedulerOutput, request: Request, encode: list[int], start: int, num_new: int) -> None:
        """Commit ``fit``'s answer once the chunk is scheduled: the step encodes ``encode`` in
        room made for them, and a reference on every image the chunk reads until the request computes past it (the
        cached ones first: making room must not evict them)."""
        for feature in request.mm_features:
            if feature.identifier in self.cache and feature.position.overlaps(start, start + num_new):
                self.cache.add_ref(feature.identifier, request.request_id)
        for i in encode:
            feature = request.mm_features[i]
            self.cache.allocate(feature.identifier, feature.position.length, request.request_id)
            self.budget_left -= feature.position.length
            self.num_encoded += 1
        if encode:
            out.scheduled_encoder_inputs[request.request_id] = encode

    def advance(self, request: Request) -> None:
        """Release the images the request has computed past."""
        for feature in request.mm_features:
            if feature.position.end <= request.num_computed_tokens:
                self.cache.release(feature.identifier, request.request_id)

    def free(self, request: Request) -> None:
        """The request finished or was preempted: it reads none of its images any more."""
        for feature in request.mm_features:
            self.cache.release(feature.identifier, request.request_id)
