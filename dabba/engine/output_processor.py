"""Engine-side state of each request's output: incremental text, stop strings, logprobs, and
the fan-in of n parallel samples into one RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

from dabba.core.outputs import TokenLogprobs
from dabba.core.request import Request
from dabba.engine.detokenizer import IncrementalDetokenizer
from dabba.engine.tokenizer import Tokenizer
from dabba.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from dabba.sampling_params import SamplingParams


@dataclass
class SampleState:
    """One of a prompt's n samples (a core Request of its own)."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.status.is_finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.sample_of: dict[str, tuple[ParentState, SampleState]] = {}  # child request id ->
        self._token_text: dict[int, str] = {}

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams, children: list[Request]) -> None:
        parent = ParentState(request_id, prompt, list(children[0].prompt_token_ids))
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
        for child in children:
            sample = SampleState(child, IncrementalDetokenizer(self.tokenizer, child.sampling_params),
                                 [] if params.logprobs is not None else None,
                                 0.0 if params.logprobs is not None else None)
            parent.samples.append(sample)
            self.sample_of[child.request_id] = (parent, sample)
        self.parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [s.request.request_id for s in parent.samples] if parent else []

    def remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for sample in parent.samples if parent else []:
            self.sample_of.pop(sample.request.request_id, None)

    # ---- per step ------------------------------------------------------------------------
    def add_prompt_logprobs(self, prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]) -> None:
        for request_id, (start, entries) in prompt_logprobs.items():
            parent, sample = self.sample_of[request_id]
            if parent.prompt_logprobs is None or sample is not parent.samples[0]:
                continue  # samples share the prompt: the first one's are kept
            for offset, entry in enumerate(entries):  # a recomputed (preempted) prompt overwrites equal values
                parent.prompt_logprobs[start + offset] = self._position(entry)

    def update(self, request: Request, logprobs: TokenLogprobs | None) -> str | None:
        """Take the request's newest token; returns a stop string if the text now ends one."""
        _, sample = self.sample_of[request.request_id]
        if logprobs is not None and sample.logprobs is not None:
            sample.logprobs.append(self._position(logprobs))
            sample.cumulative_logprob += logprobs.logprobs[0]
        # Like stop tokens, stop strings do not count before min_tokens.
        check_stop = request.num_output_tokens > request.sampling_params.min_tokens
        return sample.detokenizer.update(request.output_token_ids[-1:], check_stop)

    def make_output(self, request_id: str) -> RequestOutput:
        """The prompt's output now (all samples); forgets the prompt once every sample finished."""
        parent, _ = self.sample_of[request_id]
        finished = parent.finished
        outputs = []
        for index, sample in enumerate(parent.samples):
            req = sample.request
            done = req.status.is_finished
            outputs.append(CompletionOutput(
                index=index,
                text=sample.detokenizer.output_text(done),
                token_ids=list(req.output_token_ids),
                finish_reason=req.status.finish_reason if done else None,
                stop_reason=req.stop_reason,
                logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                cumulative_logprob=sample.cumulative_logprob,
            ))
        if finished:
            self.remove(parent.request_id)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=max(parent.samples[0].request.num_cached_tokens, 0),
            prompt_logprobs=list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None,
        )

    def _position(self, entry: TokenLogprobs) -> PositionLogprobs:
        position = {}
        for i, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
            if token_id not in position:  # the chosen token may also be among the top N
                position[token_id] = Logprob(logprob, entry.rank if i == 0 else i, self._text_of(token_id))
        return position

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
