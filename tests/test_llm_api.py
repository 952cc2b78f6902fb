"""The LLM API end to end: prompt forms, stopping, seeds, rejection, progress bar, options."""
from __future__ import annotations

import json
import shutil

import pytest

from dabba import LLM, SamplingParams
from tests.conftest import Checkpoint, run_checked, token_prompts


@pytest.fixture(scope="module")
def llama(checkpoints) -> Checkpoint:
    return checkpoints["llama"]


@pytest.fixture(scope="module")
def llm(llama) -> LLM:
    return LLM(str(llama.path), dtype="float32")


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def test_mixed_prompt_forms_in_input_order(llm, llama) -> None:
    from transformers import AutoModelForCausalLM
    from tests.conftest import hf_greedy

    tok = llm.get_tokenizer()
    texts = ["Return a new list.", "The json module", "x"]
    prompts = [texts[0], {"prompt_token_ids": llama.prompts[3]}, {"prompt": texts[1]}, texts[2],
               {"prompt_token_ids": llama.prompts[9]}]
    outs = llm.generate(prompts, greedy(20, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(llama.path)
    expected_ids = [tok.encode(texts[0]), llama.prompts[3], tok.encode(texts[1]), tok.encode(texts[2]), llama.prompts[9]]
    refs = hf_greedy(hf, expected_ids, 20)
    for out, ids, ref in zip(outs, expected_ids, refs):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tok.decode(ref)
        assert out.finished
    assert [o.prompt for o in outs] == [texts[0], None, texts[1], texts[2], None]


def test_stop_token_ids(llm, llama) -> None:
    ref = llama.reference[6]
    stop = ref[9]
    k = ref.index(stop)
    out = llm.generate({"prompt_token_ids": llama.prompts[6]}, greedy(64, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[: k + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)


def test_eos_from_generation_config(llama, tmp_path) -> None:
    path = shutil.copytree(llama.path, tmp_path / "ck")
    ref = llama.reference[7]
    eos = ref[12]
    k = ref.index(eos)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, eos]
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(path), dtype="float32")
    assert eos in llm.llm_engine.model_info.eos_token_ids and 1 in llm.llm_engine.model_info.eos_token_ids
    prompt = {"prompt_token_ids": llama.prompts[7]}
    out = llm.generate(prompt, greedy(64), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = llm.generate(prompt, greedy(64, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_requests_join_while_others_run(llm, llama) -> None:
    engine = llm.llm_engine
    params = greedy(64, ignore_eos=True)
    for i in range(0, 6):
        engine.add_request(f"a{i}", {"prompt_token_ids": llama.prompts[i]}, params)
    results = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 5:  # the first ones are decoding by now: the rest join mid-flight
            for i in range(6, len(llama.prompts)):
                engine.add_request(f"a{i}", {"prompt_token_ids": llama.prompts[i]}, params)
        for out in engine.step():
            results[out.request_id] = out
        engine.engine_core.kv_cache_manager.check_integrity()
        steps += 1
    for i, ref in enumerate(llama.reference):
        assert results[f"a{i}"].outputs[0].token_ids == ref


def test_seeded_sampling_is_independent_of_the_batch(llama) -> None:
    llm = LLM(str(llama.path), dtype="float32")
    p = llama.prompts[5]
    alone = llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=32, temperature=1.0, seed=7), use_tqdm=False)
    others = [SamplingParams(max_tokens=32, temperature=0.8), SamplingParams(max_tokens=5, temperature=0),
              SamplingParams(max_tokens=32, temperature=1.0, seed=7), SamplingParams(max_tokens=32, temperature=1.0, seed=8)]
    batch = llm.generate(token_prompts([llama.prompts[1], llama.prompts[8], p, p]), others, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert batch[3].outputs[0].token_ids != alone[0].outputs[0].token_ids
    assert alone[0].outputs[0].token_ids != llama.reference[5][:32], "temperature 1 should leave the greedy path"
    # and under preemption (a tiny cache forces recompute mid-generation)
    from tests.test_parity import _bytes_per_block

    small = LLM(str(llama.path), dtype="float32", kv_cache_memory=30 * _bytes_per_block(llama.path))
    outs = run_checked(small, token_prompts(llama.prompts[6:] + [p]),
                       [SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)] * 6
                       + [SamplingParams(max_tokens=32, temperature=1.0, seed=7)])
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert outs[-1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_too_long_request_is_rejected_and_others_carry_on(llm, llama) -> None:
    engine = llm.llm_engine
    engine.add_request("ok", {"prompt_token_ids": llama.prompts[5]}, greedy(64, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(512\)"):
        engine.add_request("bad", {"prompt_token_ids": [5] * 500}, greedy(64))
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o for o in engine.step()})
    assert list(results) == ["ok"]
    assert results["ok"].outputs[0].token_ids == llama.reference[5]


def test_request_larger_than_the_cache_is_rejected(llama) -> None:
    from tests.test_parity import _bytes_per_block

    llm = LLM(str(llama.path), dtype="float32", kv_cache_memory=4 * _bytes_per_block(llama.path))
    with pytest.raises(ValueError, match="needs 5 KV blocks but the cache has only 4"):
        llm.generate({"prompt_token_ids": llama.prompts[6]}, greedy(16), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm, llama) -> None:
    prompts = token_prompts(llama.prompts[:3]) + [{"prompt_token_ids": [1, 99999]}]
    with pytest.raises(ValueError, match="outside"):
        llm.generate(prompts, greedy(8), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.pool.num_free_blocks == kv.num_usable_blocks


def test_max_tokens_none_runs_to_max_model_len(llama) -> None:
    llm = LLM(str(llama.path), dtype="float32", max_model_len=40)
    out = llm.generate({"prompt_token_ids": llama.prompts[4]}, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40 - 17
    assert out.outputs[0].finish_reason == "length"


def test_priority_orders_admission(llama) -> None:
    llm = LLM(str(llama.path), dtype="float32", max_num_seqs=1)
    engine = llm.llm_engine
    for rid, prio in [("low", 5), ("high", -1), ("mid", 0)]:
        engine.add_request(rid, {"prompt_token_ids": llama.prompts[3]}, greedy(4), priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_kv_cache_plan_is_logged(llama, dabba_log) -> None:
    from tests.test_parity import _bytes_per_block

    LLM(str(llama.path), dtype="float32", kv_cache_memory=100 * _bytes_per_block(llama.path), max_model_len=320)
    lines = [r.getMessage() for r in dabba_log]
    assert any("100 blocks of 16 tokens" in m and "holds 5.00 concurrent sequences of max_model_len=320" in m
               for m in lines), lines


def test_progress_bar(llm, llama, capsys) -> None:
    llm.generate(token_prompts(llama.prompts[:3]), greedy(4), use_tqdm=True)
    assert "Generating" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=12), "block_size"),
    (dict(dtype="int3"), "dtype"),
    (dict(max_num_batched_token=8), "unknown option"),
    (dict(max_model_len=4096), "exceeds the model's limit"),
])
def test_bad_engine_options(llama, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(llama.path), **kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"), (dict(max_tokens=0), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed="x"), "seed"),
])
def test_bad_sampling_params(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_reset_prefix_cache_makes_the_next_prompt_prefill_in_full(checkpoints) -> None:
    llm = LLM(str(checkpoints["llama"].path), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(10, 60))}  # 3 full blocks of 16, then 2
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.get_stats().prefix_cache_hit_tokens == 48
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.get_stats().prefix_cache_hit_tokens == 48  # no new hit
    llm.llm_engine.add_request("running", prompt, params)
    assert llm.reset_prefix_cache() is False  # refused while a request is unfinished


def test_get_stats_counts_a_shared_prefix_once(checkpoints) -> None:
    llm = LLM(str(checkpoints["llama"].path), dtype="float32")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefix = list(range(10, 58))  # 3 full blocks of 16
    engine.add_request("a", {"prompt_token_ids": prefix + [1, 2, 3]}, params)
    engine.step()  # a: 51 prompt tokens computed
    engine.add_request("b", {"prompt_token_ids": prefix + [4, 5]}, params)
    engine.step()  # b reuses a's 3 prefix blocks and computes 2 tokens; a decodes one
    stats = llm.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)
    assert stats.kv_blocks_used == 3 + 1 + 1  # shared prefix, then a tail block each
    assert stats.kv_slots_allocated == 5 * 16
    assert stats.kv_tokens_stored == 48 + 4 + 2
    assert stats.kv_slot_utilization == 54 / 80
    assert stats.prefix_cache_hit_tokens == 48 and stats.prefix_cache_hit_rate == 48 / (51 + 50)
    assert stats.kv_cache_usage == 5 / stats.kv_blocks_total
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.get_stats().kv_tokens_stored == 0 and llm.get_stats().num_running_reqs == 0


def test_chat_renders_conversations_with_the_template_and_its_kwargs(llama, tmp_path) -> None:
    """LLM.chat: one conversation or several, through the model's template, a chat_template in its
    place (the engine's --chat-template, a file or the text, or one call's), and chat_template_kwargs."""
    template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                "{% if enable_thinking is false %}(no thinking)\n{% endif %}{% if add_generation_prompt %}[assistant]"
                "{% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    llm = LLM(str(llama.path), dtype="float32", chat_template=str(tmp_path / "t.jinja"))
    one = [{"role": "user", "content": "Hi"}]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}, *one]
    outs = llm.chat([one, parts], greedy(3), use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert [o.prompt for o in outs] == ["[user] Hi\n(no thinking)\n[assistant]",
                                        "[system] Be brief.\n[user] Hi\n(no thinking)\n[assistant]"]
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    tokenizer = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tokenizer.encode(outs[0].prompt, add_special_tokens=False)
    (out,) = llm.chat(one, greedy(1), use_tqdm=False, chat_template="{{ messages[0].content }}!")
    assert out.prompt == "Hi!"
    assert LLM(str(llama.path), dtype="float32", chat_template=template).chat(one, greedy(1), use_tqdm=False)[0] \
        .prompt == "[user] Hi\n[assistant]"
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(one, greedy(1), chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="chat template failed"):
        llm.chat(one, greedy(1), chat_template="{{ raise_exception('no system turn') }}")
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], greedy(1))
    with pytest.raises(ValueError, match="chat_template"):
        LLM(str(llama.path), dtype="float32", chat_template="no/such/file.jinja")
