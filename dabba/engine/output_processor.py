"""Engine-side state of each request's output, fed only by the core's EngineCoreOutputs (it never
sees a Request or the Scheduler): incremental text, stop strings, logprobs, the fan-in of n
parallel samples into one RequestOutput, and what each output carries (its RequestOutputKind).

Stop strings are found here, in the text, which the core never sees: the requests they end come
back to the engine (``ProcessedOutputs.reqs_to_finish``), which finishes them in the scheduler by id.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dabba.core.outputs import EngineCoreOutput, EngineCoreOutputs, TokenLogprobs
from dabba.engine.detokenizer import IncrementalDetokenizer
from dabba.engine.tokenizer import Tokenizer
from dabba.outputs import (CompletionOutput, EmbeddingOutput, Logprob, PoolingRequestOutput, PositionLogprobs,
                           RequestOutput)
from dabba.pooling_params import PoolingParams
from dabba.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SampleState:
    """One of a prompt's n samples (a core request of its own, ``request_id``)."""

    request_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None  # when asked
    cumulative_logprob: float | None = None  # when logprobs were asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # with finish_reason "error"
    num_tokens_sent: int = 0  # DELTA: tokens (and their logprobs) already in an output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ParentState:
    """One prompt as the caller submitted it, with its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # the first sample's (samples share the prompt)
    num_cached_tokens: int = 0  # the first sample's
    embedding: list[float] | None = None  # a pooling request's, once its input went through
    pooling: bool = False  # a pooling request (its one sample never samples)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class RequestIterationStats:
    """One prompt's step, for metrics: the same whatever output kind it asked for."""

    num_prompt_tokens: int  # prompt tokens x samples
    is_first: bool  # its first generated tokens came this step
    num_new_tokens: int = 0  # generated this step, over all its samples
    num_output_tokens: int = 0  # its longest sample's, so far
    finished: bool = False


@dataclass
class IterationStats:
    """What one step generated (vLLM v1's IterationStats), per prompt that got tokens."""

    requests: dict[str, RequestIterationStats] = field(default_factory=dict)


@dataclass
class ProcessedOutputs:
    """One step, for the engine: outputs for the caller, requests to finish, stats for metrics."""

    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    reqs_to_finish: dict[str, str] = field(default_factory=dict)  # core request id -> stop string in its text
    iteration_stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.sample_of: dict[str, tuple[ParentState, SampleState]] = {}  # core request id ->
        self._token_text: dict[int, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams, child_ids: list[str]) -> None:
        """A prompt whose ``params.n`` samples run in the core as ``child_ids`` (a pooling
        request: one, whose output is its embedding)."""
        if isinstance(params, PoolingParams):
            parent = ParentState(request_id, prompt, prompt_token_ids, SamplingParams(max_tokens=1), pooling=True)
            sample = SampleState(child_ids[0], 0, IncrementalDetokenizer(self.tokenizer, parent.params))
            parent.samples.append(sample)
            self.sample_of[child_ids[0]] = (parent, sample)
            self.parents[request_id] = parent
            return
        parent = ParentState(request_id, prompt, prompt_token_ids, params)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        for index, child_id in enumerate(child_ids):
            sample = SampleState(child_id, index, IncrementalDetokenizer(self.tokenizer, params))
            if params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            parent.samples.append(sample)
            self.sample_of[child_id] = (parent, sample)
        self.parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [s.request_id for s in parent.samples] if parent else []

    def remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for sample in parent.samples if parent else []:
            self.sample_of.pop(sample.request_id, None)

    # ---- per step ------------------------------------------------------------------------
    def process_outputs(self, core_outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Take one step's news; returns a RequestOutput per prompt that has one to give under
        its output kind (in the order the prompts first appear in the step), and forgets the
        prompts whose samples all finished."""
        result = ProcessedOutputs()
        changed: dict[str, list[SampleState]] = {}  # prompt id -> its samples with new tokens
        for out in core_outputs.outputs:
            found = self.sample_of.get(out.request_id)
            if found is None or found[1].finished:
                continue  # aborted, or already ended by a stop string
            parent, sample = found
            if sample is parent.samples[0]:
                parent.num_cached_tokens = out.num_cached_tokens
                if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
                    start, entries = out.new_prompt_logprobs
                    for offset, entry in enumerate(entries):  # a recomputed (preempted) prompt rewrites equal values
                        parent.prompt_logprobs[start + offset] = self._position(entry)
            if not out.new_token_ids and not out.finished:
                continue  # a prompt chunk
            if parent.pooling:
                parent.embedding = out.pooling_output
                sample.finish_reason, sample.error = out.finish_reason, out.error
            stats = result.iteration_stats.requests.get(parent.request_id)
            if stats is None:
                stats = result.iteration_stats.requests[parent.request_id] = RequestIterationStats(
                    len(parent.prompt_token_ids) * len(parent.samples), not any(s.token_ids for s in parent.samples))
            stats.num_new_tokens += len(out.new_token_ids)
            if parent.pooling:
                changed.setdefault(parent.request_id, []).append(sample)
                continue
            stop = self._update_sample(sample, out, parent.params.min_tokens)
            if stop is not None and not out.finished:
                result.reqs_to_finish[sample.request_id] = stop
            changed.setdefault(parent.request_id, []).append(sample)

        for request_id, samples in changed.items():
            parent = self.parents[request_id]
            stats = result.iteration_stats.requests[request_id]
            stats.num_output_tokens = max(len(s.token_ids) for s in parent.samples)
            stats.finished = parent.finished
            output = self._make_output(parent, samples, stats.is_first)
            if output is not None:
                result.request_outputs.append(output)
            if parent.finished:
                self.remove(request_id)
        return result

    def _update_sample(self, sample: SampleState, out: EngineCoreOutput, min_tokens: int) -> str | None:
        """Take a sample's new tokens; returns a stop string if its text now ends one. The token
        that stopped the request in the core (EOS, a stop token id: always the last) is not text
        unless include_stop_str_in_output, as in vLLM: with skip_special_tokens off a reply must
        not end in "</s>"."""
        stop = None
        stop_token = (out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
                      and not sample.detokenizer.include_stop)
        last = len(out.new_token_ids) - 1
        for i, token_id in enumerate(out.new_token_ids):  # several with speculative decoding: a stop string cuts them
            sample.token_ids.append(token_id)
            if sample.logprobs is not None and out.new_logprobs is not None:
                entry = out.new_logprobs[i]
                sample.logprobs.append(self._position(entry))
                sample.cumulative_logprob += entry.logprobs[0]
            if stop_token and i == last:
                break
            # Like stop tokens, stop strings do not count before min_tokens.
            stop = sample.detokenizer.update([token_id], check_stop=len(sample.token_ids) > min_tokens)
            if stop is not None:
                break
        if stop is not None:  # it wins even when the same token also ended the request in the core
            sample.finish_reason, sample.stop_reason = "stop", stop
        else:
            sample.finish_reason, sample.stop_reason, sample.error = out.finish_reason, out.stop_reason, out.error
        return stop

    def _make_output(self, parent: ParentState, changed: list[SampleState],
                     is_first: bool) -> RequestOutput | PoolingRequestOutput | None:
        """CUMULATIVE: every sample, everything so far. FINAL_ONLY: the same, once, when all
        finished. DELTA: only the samples that changed, only what is new; the prompt only in
        the prompt's first output."""
        if parent.pooling:  # aborted or failed without an embedding: it gives nothing
            if parent.embedding is None:
                return None
            return PoolingRequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                                        EmbeddingOutput(parent.embedding), True, parent.num_cached_tokens)
        kind = parent.params.output_kind
        finished = parent.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            outputs = [self._delta(s) for s in sorted(changed, key=lambda s: s.index)]
        else:
            outputs = [self._cumulative(s, copy=not finished) for s in parent.samples]
        with_prompt = kind != RequestOutputKind.DELTA or is_first
        prompt_logprobs = None
        if parent.prompt_logprobs is not None and with_prompt:
            prompt_logprobs = list(parent.prompt_logprobs) if not finished else parent.prompt_logprobs
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt if with_prompt else None,
            prompt_token_ids=parent.prompt_token_ids if with_prompt else [],
            outputs=outputs,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _cumulative(sample: SampleState, copy: bool) -> CompletionOutput:
        """Everything so far; the lists are copied while the sample can still grow them."""
        logprobs = sample.logprobs
        return CompletionOutput(
            index=sample.index,
            text=sample.detokenizer.output_text(sample.finished),
            token_ids=list(sample.token_ids) if copy else sample.token_ids,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            logprobs=list(logprobs) if copy and logprobs is not None else logprobs,
            cumulative_logprob=sample.cumulative_logprob,
            error=sample.error,
        )

    @staticmethod
    def _delta(sample: SampleState) -> CompletionOutput:
        """What is new since the sample's previous output: the deltas concatenate to the
        cumulative output, token for token and character for character."""
        start = sample.num_tokens_sent
        sample.num_tokens_sent = len(sample.token_ids)
        return CompletionOutput(
            index=sample.index,
            text=sample.detokenizer.new_output_text(sample.finished),
            token_ids=sample.token_ids[start:],
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            logprobs=sample.logprobs[start:] if sample.logprobs is not None else None,
            cumulative_logprob=sample.cumulative_logprob,
            error=sample.error,
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
