"""The OutputProcessor alone, fed EngineCoreOutputs built by hand (no Request, no Scheduler, no
model): the three output kinds give the same result, DELTA outputs add up to the CUMULATIVE ones
step by step, FINAL_ONLY speaks once, and stop strings come back as request ids to finish."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dabba.core.outputs import EngineCoreOutput, EngineCoreOutputs, TokenLogprobs
from dabba.engine.output_processor import IterationStats, OutputProcessor, RequestIterationStats
from dabba.engine.tokenizer import Tokenizer
from dabba.outputs import CompletionOutput, Logprob, RequestOutput
from dabba.sampling_params import RequestOutputKind, SamplingParams

KINDS = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)
PROMPT = "Return"
TEXT_0 = "Return a new list."  # sample 0 runs into the stop string "new" (2 characters held back)
TEXT_1 = "café 🙂 ok"  # sample 1: characters split across tokens; the core ends it at max_tokens


@pytest.fixture(scope="module")
def tokenizer(checkpoints) -> Tokenizer:
    return Tokenizer(checkpoints["llama"].path)


def lp(token_id: int, k: int) -> TokenLogprobs:
    """Logprobs with values that differ per step, so sums and positions are checkable."""
    return TokenLogprobs([token_id, 5], [-0.25 * (k + 1), -3.0], 1 + k % 2)


def stop_index(tokenizer: Tokenizer, token_ids: list[int], stop: str) -> int:
    """The token that completes ``stop`` in the full decode (the oracle)."""
    return next(k for k in range(len(token_ids)) if stop in tokenizer.decode(token_ids[: k + 1]))


def script(tokenizer: Tokenizer) -> tuple[list[int], list[int], list[int], list[EngineCoreOutputs]]:
    """The core's side of a prompt with n=2 (children p#0, p#1), one token per sample per step:
    a prompt chunk with only prompt logprobs first; sample 0's stop string is the engine's to
    find, so the core sends it one more token (as it would if it ran ahead; to be ignored)."""
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    ids_1 = tokenizer.encode(TEXT_1, add_special_tokens=False)
    all_ids_0 = tokenizer.encode(TEXT_0, add_special_tokens=False)
    ids_0 = all_ids_0[: stop_index(tokenizer, all_ids_0, "new") + 2]
    assert len(prompt) >= 1 and len(ids_1) > len(ids_0) > 3
    steps = [EngineCoreOutputs([
        EngineCoreOutput("p#0", [], new_prompt_logprobs=(0, [lp(t, 9) for t in prompt[:1]]), num_cached_tokens=0),
        EngineCoreOutput("p#1", [], new_prompt_logprobs=(0, [lp(t, 7) for t in prompt[:1]]), num_cached_tokens=3),
    ])]
    for k in range(len(ids_1)):
        outs = []
        if k < len(ids_0):
            prompt_lps = (1, [lp(t, 8) for t in prompt[1:]]) if k == 0 else None
            outs.append(EngineCoreOutput("p#0", [ids_0[k]], new_logprobs=[lp(ids_0[k], k)],
                                         new_prompt_logprobs=prompt_lps, num_cached_tokens=0))
        last = k == len(ids_1) - 1
        outs.append(EngineCoreOutput("p#1", [ids_1[k]], "length" if last else None, None, [lp(ids_1[k], k)],
                                     num_cached_tokens=3))
        steps.append(EngineCoreOutputs(outs))
    return prompt, ids_0, ids_1, steps


def run(tokenizer: Tokenizer, kind: RequestOutputKind, steps: list[EngineCoreOutputs]):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, stop=["new"], logprobs=1, prompt_logprobs=1, output_kind=kind)
    prompt_token_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    processor.add_request("p", PROMPT, prompt_token_ids, params, ["p#0", "p#1"])
    results = [processor.process_outputs(step) for step in steps]
    assert processor.parents == {} and processor.sample_of == {}  # all finished: forgotten
    return results


def position(tokenizer: Tokenizer, entry: TokenLogprobs) -> dict[int, Logprob]:
    """The chosen token with its rank, then token 5 as the top-1 (unless it is the chosen one)."""
    result = {}
    for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, [entry.rank, 1]):
        result.setdefault(token_id, Logprob(logprob, rank, tokenizer.decode([token_id], skip_special_tokens=False)))
    return result


def test_cumulative_outputs_of_a_scripted_prompt(tokenizer) -> None:
    prompt, ids_0, ids_1, steps = script(tokenizer)
    stop_at = stop_index(tokenizer, ids_0, "new")
    results = run(tokenizer, RequestOutputKind.CUMULATIVE, steps)

    assert results[0].request_outputs == []  # a prompt chunk alone has nothing to say
    assert [r.reqs_to_finish for r in results] == [{}] * (stop_at + 1) + [{"p#0": "new"}] + [{}] * (
        len(ids_1) - stop_at - 1)
    assert [len(r.request_outputs) for r in results[1:]] == [1] * len(ids_1)
    final = results[-1].request_outputs[0]
    assert final == RequestOutput(
        request_id="p", prompt=PROMPT, prompt_token_ids=prompt, finished=True, num_cached_tokens=0,
        prompt_logprobs=[position(tokenizer, lp(prompt[0], 9))] + [position(tokenizer, lp(t, 8)) for t in prompt[1:]],
        outputs=[
            CompletionOutput(0, "Return a ", ids_0[: stop_at + 1], "stop", "new",
                             [position(tokenizer, lp(t, k)) for k, t in enumerate(ids_0[: stop_at + 1])],
                             sum(-0.25 * (k + 1) for k in range(stop_at + 1))),
            CompletionOutput(1, TEXT_1, ids_1, "length", None,
                             [position(tokenizer, lp(t, k)) for k, t in enumerate(ids_1)],
                             sum(-0.25 * (k + 1) for k in range(len(ids_1)))),
        ])
    # While running, the last 2 characters are held back; "new" itself is never shown.
    texts_0 = [r.request_outputs[0].outputs[0].text for r in results[1: stop_at + 1]]
    assert texts_0 == [tokenizer.decode(ids_0[: k + 1])[:-2] for k in range(stop_at)]


def test_every_output_kind_tells_the_same_story(tokenizer) -> None:
    """DELTA outputs, added up, equal the CUMULATIVE output of the same step, token for token and
    character for character; FINAL_ONLY gives only the last CUMULATIVE output; the stop string to
    act on and the stats are the same whatever the kind."""
    _, _, _, steps = script(tokenizer)
    cumulative, delta, final_only = (run(tokenizer, kind, steps) for kind in KINDS)

    for results in (delta, final_only):
        assert [r.reqs_to_finish for r in results] == [r.reqs_to_finish for r in cumulative]
        assert [r.iteration_stats for r in results] == [r.iteration_stats for r in cumulative]

    assert [r.request_outputs for r in final_only] == [[]] * (len(steps) - 1) + [cumulative[-1].request_outputs]

    summed: dict[int, CompletionOutput] = {}
    for step, (c, d) in enumerate(zip(cumulative, delta)):
        assert [o.request_id for o in d.request_outputs] == [o.request_id for o in c.request_outputs]
        if not c.request_outputs:
            continue
        (c_out,), (d_out,) = c.request_outputs, d.request_outputs
        assert (d_out.finished, d_out.num_cached_tokens) == (c_out.finished, c_out.num_cached_tokens)
        first = step == 1
        assert (d_out.prompt, d_out.prompt_token_ids, d_out.prompt_logprobs) == (
            (c_out.prompt, c_out.prompt_token_ids, c_out.prompt_logprobs) if first else (None, [], None))
        # only the samples that changed, each once, in index order
        assert [o.index for o in d_out.outputs] == sorted({o.index for o in d_out.outputs})
        assert all(o.token_ids for o in d_out.outputs)
        for o in d_out.outputs:
            s = summed.setdefault(o.index, CompletionOutput(o.index, "", [], None, logprobs=[]))
            s.text += o.text
            s.token_ids += o.token_ids
            s.logprobs += o.logprobs
            s.finish_reason, s.stop_reason, s.cumulative_logprob = o.finish_reason, o.stop_reason, o.cumulative_logprob
        assert [summed[o.index] for o in c_out.outputs if o.index in summed] == [
            o for o in c_out.outputs if o.token_ids]
    assert len(summed) == 2


def test_iteration_stats_count_tokens_per_prompt(tokenizer) -> None:
    prompt, ids_0, ids_1, steps = script(tokenizer)
    stop_at = stop_index(tokenizer, ids_0, "new")
    stats = [r.iteration_stats for r in run(tokenizer, RequestOutputKind.FINAL_ONLY, steps)]
    assert stats[0] == IterationStats()
    assert stats[1] == IterationStats({"p": RequestIterationStats(2 * len(prompt), True, 2, 1, False)})
    # after the stop string, sample 0's extra token is ignored: 1 new token a step
    assert [s.requests["p"].num_new_tokens for s in stats[1:]] == [2] * (stop_at + 1) + [1] * (len(ids_1) - stop_at - 1)
    assert [s.requests["p"].num_output_tokens for s in stats[1:]] == list(range(1, len(ids_1) + 1))
    assert [s.requests["p"].finished for s in stats[1:]] == [False] * (len(ids_1) - 1) + [True]
    assert [s.requests["p"].is_first for s in stats[1:]] == [True] + [False] * (len(ids_1) - 1)


def test_max_tokens_and_a_stop_string_on_the_same_token_end_with_the_stop_string(tokenizer) -> None:
    ids = tokenizer.encode("Return a new list.", add_special_tokens=False)
    k = stop_index(tokenizer, ids, "new")
    processor = OutputProcessor(tokenizer)
    processor.add_request("q", None, [7], SamplingParams(stop=["new"], output_kind=RequestOutputKind.DELTA), ["q"])
    texts = []
    for i in range(k + 1):  # the core ends it at max_tokens on the token that completes "new"
        result = processor.process_outputs(EngineCoreOutputs([
            EngineCoreOutput("q", [ids[i]], "length" if i == k else None, num_cached_tokens=0)]))
        texts += [o.text for out in result.request_outputs for o in out.outputs]
    assert result.reqs_to_finish == {}  # already finished in the core: nothing to tell it
    (out,) = result.request_outputs
    assert (out.finished, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (True, "stop", "new")
    assert "".join(texts) == "Return a "


def test_stop_strings_wait_for_min_tokens(tokenizer) -> None:
    ids = tokenizer.encode("Return a new list. Return a new list.", add_special_tokens=False)
    first = stop_index(tokenizer, ids, "new")
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["new"], min_tokens=first + 1, output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("m", None, [7], params, ["m"])
    for i, token_id in enumerate(ids):
        result = processor.process_outputs(EngineCoreOutputs([EngineCoreOutput("m", [token_id])]))
        if result.reqs_to_finish:
            break
    assert result.reqs_to_finish == {"m": "new"} and i > first
    assert result.request_outputs[0].outputs[0].text == "Return a new list. Return a "


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("include_stop", [False, True])
def test_the_token_that_stopped_a_request_is_text_only_when_asked(tokenizer, skip_special_tokens,
                                                                   include_stop) -> None:
    """EOS (special) or a stop token id (any token) ends the request in the core: as in vLLM, its
    text is not the reply's unless include_stop_str_in_output (then as skip_special_tokens says)."""
    ids = tokenizer.encode("Return a new list", add_special_tokens=False)
    period = tokenizer.encode(".", add_special_tokens=False)
    for last, stop_reason in ((tokenizer.eos_token_id, None), (*period, *period)):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(skip_special_tokens=skip_special_tokens, include_stop_str_in_output=include_stop,
                                stop_token_ids=period, output_kind=RequestOutputKind.FINAL_ONLY)
        processor.add_request("s", None, [7], params, ["s"])
        processor.process_outputs(EngineCoreOutputs([EngineCoreOutput("s", ids[:-1])]))
        result = processor.process_outputs(EngineCoreOutputs([EngineCoreOutput("s", [ids[-1], last], "stop", stop_reason)]))
        (out,) = result.request_outputs[0].outputs
        shown = tokenizer.decode([last], skip_special_tokens=skip_special_tokens) if include_stop else ""
        assert (out.text, out.token_ids, out.finish_reason) == ("Return a new list" + shown, [*ids, last], "stop")


def test_outputs_of_an_aborted_prompt_are_ignored(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", None, [7], SamplingParams(n=2), ["a#0", "a#1"])
    assert processor.child_ids("a") == ["a#0", "a#1"]
    processor.remove("a")
    result = processor.process_outputs(EngineCoreOutputs([EngineCoreOutput("a#0", [8])]))
    assert (result.request_outputs, result.reqs_to_finish, result.iteration_stats) == ([], {}, IterationStats())
    assert processor.child_ids("a") == []


def test_the_output_processor_never_imports_the_scheduler_or_requests() -> None:
    code = ("import sys, dabba.engine.output_processor; "
            "print(sorted(m for m in ('dabba.core.request', 'dabba.core.scheduler', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
