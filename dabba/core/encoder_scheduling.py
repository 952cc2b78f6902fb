"""Which images a step encodes, and where a prompt chunk stops for them (vLLM v1's encoder budget).

A chunk that reaches an image's tokens needs the image's embeddings: they are in the encoder
cache already (an earlier chunk, request or turn encoded the same image), or the step encodes
the image. The images an encoding starts per step are bounded (``budget``, in embedding rows) and
by the cache's room. A step runs every encoding to its end before its forward, unless the step
is given a share of encoding (``work``, while other requests decode, core/image_budget.py): then an
encoding runs over several steps, and its image's tokens wait until the worker says it ended.
A chunk whose next image is not encoded by the time it runs stops before that image's tokens.

``whole_items``: the model's image tokens attend to each other both ways (Gemma 3), so a chunk
may not stop inside an image; every image token of a chunk sees the image's last token, whose key
must be in the cache by then. A chunk may start inside one (after a prefix-cache hit): the
cached part was computed with the whole image, which its blocks' hashes name.

    prompt:  | text | image 0 (encoded, cached) | text | image 1 (no room this step) | text |
    chunk:   start ...................................... end (cut to image 1's offset)
"""
from __future__ import annotations

from dabba.core.encoder_cache import EncoderCache
from dabba.core.image_budget import ImageBudget, image_prefill, image_step_mix, image_work_waits
from dabba.core.outputs import ModelRunnerOutput, SchedulerOutput
from dabba.core.request import Request
from dabba.errors import InvalidRequest


class EncoderScheduler:
    def __init__(self, budget: int, cache: EncoderCache, whole_items: bool, max_num_batched_tokens: int,
                 decode_slowdown: float = 0.0) -> None:
        self.budget = budget  # embedding rows whose encodings may start in one step
        self.cache = cache
        self.whole_items = whole_items
        self.max_num_batched_tokens = max_num_batched_tokens
        self.budget_left = budget
        self.work: float | None = None  # this step's operations of encoding; None: every encoding ends this step
        self.num_encoded = 0  # images encoded since the start (LLM.get_stats, /metrics)
        # image requests' share of a step while others decode (None: no limit)
        self.ration = ImageBudget(decode_slowdown) if decode_slowdown > 1.0 else None
        self._mix: tuple[int, int, int] | None = None  # the last rationed step's (image_budget.image_step_mix)

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

    def begin_step(self, out: SchedulerOutput, running: list[Request], waiting: list[Request]) -> int | None:
        """The step's share of encoding (``work``, SchedulerOutput.encoder_work), and the
        prompt tokens image requests may take (None: no limit): rationed while requests decode.
        A rationed step starts the encodings the image requests wait for, in their order."""
        self.budget_left = self.budget
        self.work, tokens = None, None
        if self.ration is not None:
            decodes, prefills = image_work_waits(running, waiting)
            self.ration.begin(decodes and prefills)
            if self.ration.active:
                for request in (*running, *waiting):
                    if image_prefill(request):
                        self._start_next(out, request)
                self.work, tokens = self.ration.allowance(self.under_way)
        if self.work is None:
            self.cache.mark_ready()  # the worker ends every encoding under way before the forward
        return tokens

    def end_step(self, num_scheduled_tokens: dict[str, int], requests: dict[str, Request]) -> None:
        self._mix = image_step_mix(num_scheduled_tokens, requests) if self.work is not None else None

    def encoded(self, identifiers: list[str]) -> None:
        """The worker ended these encodings (ModelRunnerOutput.encoded_images): their tokens may run."""
        self.cache.mark_ready(identifiers)

    def record(self, runner_out: ModelRunnerOutput, seconds: float) -> None:
        """A step's time (from schedule() to its outputs processed), for the costs the ration learns."""
        if self.ration is not None and self._mix is not None:
            self.ration.record(*self._mix, runner_out.encoder_units, runner_out.encoder_work,
                               runner_out.encoder_seconds, seconds)

    def _start_next(self, out: SchedulerOutput, request: Request) -> None:
        """The encoding of the request's next image not computed nor cached, where there is room."""
        feature = next((f for f in request.mm_features
                        if f.position.end > request.num_computed_tokens and f.identifier not in self.cache), None)
        if feature is not None and feature.position.length <= min(self.budget_left, self.cache.num_free):
            self.cache.allocate(feature.identifier, feature.position.length, request.request_id, ready=False)
            self.budget_left -= feature.position.length
            self.num_encoded += 1
            out.scheduled_encoder_inputs.setdefault(request.request_id, []).append(feature)

    @property
    def under_way(self) -> bool:
        return bool(self.cache.under_way)

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
                if not self.cache.is_ready(identifier):
                    end = max(pos.offset, start)  # not until its encoding ends
                    break
                continue
            if self.work is not None or rows + pos.length > min(self.budget_left, room):
                end = max(pos.offset, start)  # (rationed: begin_step starts encodings, which end in later steps)
                break
            encode.append(i)
            rows += pos.length
        return end - start, encode

    def schedule(self, out: SchedulerOutput, request: Request, encode: list[int], start: int, num_new: int) -> None:
        """Commit ``fit``'s answer once the chunk is scheduled: the step encodes ``encode`` in
        room made for them, and a reference on every image the chunk reads until the request
        computes past it (the cached ones first: making room must not evict them)."""
        for feature in request.mm_features:
            if feature.identifier in self.cache and feature.position.overlaps(start, start + num_new):
                self.cache.add_ref(feature.identifier, request.request_id)
        for i in encode:
            feature = request.mm_features[i]
            self.cache.allocate(feature.identifier, feature.position.length, request.request_id)
            self.budget_left -= feature.position.length
            self.num_encoded += 1
        if encode:
            out.scheduled_encoder_inputs[request.request_id] = [request.mm_features[i] for i in encode]

    def advance(self, request: Request) -> None:
        """Release the images the request has computed past."""
        for feature in request.mm_features:
            if feature.position.end <= request.num_computed_tokens:
                self.cache.release(feature.identifier, request.request_id)

    def free(self, request: Request) -> None:
        """The request finished or was preempted: it reads none of its images any more."""
        for feature in request.mm_features:
            self.cache.release(feature.identifier, request.request_id)
