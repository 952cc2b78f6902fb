"""The three output kinds through the whole engine: the same tokens, text and logprobs, packed
differently. DELTA outputs add up, step by step, to the CUMULATIVE ones; FINAL_ONLY gives only the
last; LLM.generate's results are those FINAL_ONLY outputs."""
from __future__ import annotations

import dataclasses

import pytest

from dabba import LLM, SamplingParams
from dabba.outputs import CompletionOutput, RequestOutput
from dabba.sampling_params import RequestOutputKind
from tests.engine.test_detokenizer import MAX_TOKENS, PROMPT, choose_stop


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(str(checkpoints["llama"].path), dtype="float32")


def run(llm: LLM, params: SamplingParams, kind: RequestOutputKind) -> list[list[RequestOutput]]:
    """Each step's outputs for one prompt, alone in the engine (so every kind computes alike)."""
    engine = llm.llm_engine
    engine.add_request("p", PROMPT, dataclasses.replace(params, output_kind=kind))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    assert not engine.output_processor.parents
    return steps


def add_up(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """A DELTA output added to the sum of the earlier ones."""
    if total is None:
        total = dataclasses.replace(delta, outputs=[])
    samples = {o.index: o for o in total.outputs}
    for o in delta.outputs:
        s = samples.setdefault(o.index, CompletionOutput(o.index, "", [], None,
                                                         logprobs=[] if o.logprobs is not None else None))
        s.text += o.text
        s.token_ids = s.token_ids + o.token_ids
        if o.logprobs is not None:
            s.logprobs = s.logprobs + o.logprobs
        s.finish_reason, s.stop_reason, s.cumulative_logprob = o.finish_reason, o.stop_reason, o.cumulative_logprob
    return dataclasses.replace(total, outputs=sorted(samples.values(), key=lambda s: s.index),
                               finished=delta.finished, num_cached_tokens=delta.num_cached_tokens)


@pytest.fixture(scope="module")
def greedy_stop(llm) -> SamplingParams:
    """Greedy, with a stop string that spans tokens (so text is held back) and every logprob."""
    ref = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    stop, _, _ = choose_stop(llm.get_tokenizer(), ref.token_ids, ref.text)
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop], logprobs=2,
                          prompt_logprobs=1)


# Stop strings seen in these samples of the tiny random model: the samples end at different steps.
SAMPLED = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, stop=["ding", "iter", "() "], logprobs=1,
                         prompt_logprobs=0)


@pytest.mark.parametrize("which", ["greedy_stop", "sampled_n3"])
def test_every_output_kind_gives_the_same_result(llm, greedy_stop, which) -> None:
    params = greedy_stop if which == "greedy_stop" else SAMPLED
    cumulative, delta, final_only = (run(llm, params, kind) for kind in
                                     (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                      RequestOutputKind.FINAL_ONLY))
    assert len(cumulative) == len(delta) == len(final_only)
    last = cumulative[-1][0]
    assert last.finished and len(last.outputs) == params.n

    total = None
    for c_step, d_step in zip(cumulative, delta):
        assert len(c_step) == len(d_step) == 1  # every step of a lone prompt samples something
        if total is not None:
            assert (d_step[0].prompt, d_step[0].prompt_token_ids, d_step[0].prompt_logprobs) == (None, [], None)
        total = add_up(total, d_step[0])
        # the samples that have spoken so far, exactly as the cumulative output has them
        assert total.outputs == [o for o in c_step[0].outputs if o.token_ids]
        assert dataclasses.replace(total, outputs=[]) == dataclasses.replace(c_step[0], outputs=[])

    assert final_only == [[]] * (len(cumulative) - 1) + [[last]]
    # LLM.generate asks for FINAL_ONLY whatever the params say
    delta_params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    generated = llm.generate(PROMPT, delta_params, use_tqdm=False)[0]
    assert dataclasses.replace(generated, request_id="p") == last
    if which == "greedy_stop":
        assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", params.stop[0])
    else:  # so later DELTA outputs leave out the samples that finished
        assert len({len(o.token_ids) for o in last.outputs}) > 1
        assert any(o.stop_reason in params.stop for o in last.outputs)
