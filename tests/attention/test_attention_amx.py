"""The CPU backend's bf16 attention on AMX tiles (csrc/paged_attention_cpu.cpp, attention_on_amx)
against its AVX512-BF16 passes, the reference (the paged_attention op's amx=False): the same
products (bf16 q and keys, probabilities rounded to bf16, float32 sums) summed in another order,
so the bf16 outputs agree to float32 summation, not bit for bit."""
from __future__ import annotations

import pytest
import torch

from dabba.attention.cpu import CpuBackend
from dabba.ops import native
from tests.attention.test_backends import make_step

pytestmark = pytest.mark.skipif(not (native.load_cpu_ops() and native.amx_usable(32)),
                                reason="no AMX tiles here (the CPU lacks AMX-BF16 or the OS did not grant them)")

BLOCK = 16
RTOL, ATOL = 2 ** -7, 1e-2  # a bf16 output's rounding, and float32 sums in another order


class Step:
    """One step's operands in the CPU backend's layout: requests on shuffled blocks of a random
    bf16 cache whose slots past every sequence hold NaN (neither path may read them)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, query_lens: list[int],
                 context_lens: list[int], seed: int = 0) -> None:
        torch.manual_seed(seed)
        num_blocks = sum(-(-(q + c) // BLOCK) for q, c in zip(query_lens, context_lens)) + 7
        common = make_step(query_lens, context_lens, BLOCK, num_blocks, seed)
        self.metadata = CpuBackend().build_metadata(common)
        keys = torch.full((num_kv_heads, num_blocks, BLOCK, head_dim), float("nan"))
        values = keys.clone()
        for r, n in enumerate(common.seq_lens.tolist()):
            slots = torch.arange(n)
            blocks = torch.as_tensor(common.block_table[r])[slots // BLOCK]
            keys[:, blocks, slots % BLOCK] = torch.randn(num_kv_heads, n, head_dim)
            values[:, blocks, slots % BLOCK] = torch.randn(num_kv_heads, n, head_dim)
        self.key_cache = keys.bfloat16().transpose(2, 3).contiguous()  # [kv_heads, blocks, head_dim, 16]
        self.value_cache = values.bfloat16()
        self.q = torch.randn(sum(query_lens), num_heads, head_dim).bfloat16()
        self.head_dim = head_dim

    def run(self, amx: bool, window: int = 0, softcap: float = 0.0, scale: float | None = None) -> torch.Tensor:
        out = torch.empty_like(self.q)
        md = self.metadata
        torch.ops.dabba_cpu.paged_attention(out, self.q, self.key_cache, self.value_cache, md.block_table,
                                            md.query_start_loc, md.seq_lens, scale or self.head_dim ** -0.5, window,
                                            softcap, None, None, amx)
        return out.float()


def assert_agrees(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert (got - want).abs().max() <= 2 ** -6  # a couple of bf16 units at most, anywhere


# A step with prompts of 1-600 tokens among decodes; then prefill chunks after a context.
STEPS = {"fresh": ([1, 15, 16, 17, 100, 600, 1, 1], [0, 0, 0, 0, 0, 0, 300, 40]),
         "chunked": ([15, 1, 16, 17, 100, 600, 1], [50, 33, 16, 200, 64, 130, 5])}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 7, 8, 16])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_amx_passes_match_the_reference_passes(head_dim: int, group: int, step: str) -> None:
    query_lens, context_lens = STEPS[step]
    s = Step(2 * group, 2, head_dim, query_lens, context_lens)
    got, want = s.run(amx=True), s.run(amx=False)
    assert_agrees(got, want)
    assert not torch.equal(got, want), "the AMX tiles did not run (their sums round differently somewhere)"


@pytest.mark.parametrize("group", [1, 3, 8])
def test_head_dim_not_a_multiple_of_32_keeps_the_reference(group: int) -> None:
    """head_dim 48: AMX tiles take 32 dimensions at a time, so the AVX512-BF16 passes run either way."""
    s = Step(2 * group, 2, 48, *STEPS["chunked"])
    assert torch.equal(s.run(amx=True), s.run(amx=False))


@pytest.mark.parametrize("window", [1, 16, 23, 71])
@pytest.mark.parametrize("softcap, scale", [(0.0, None), (30.0, None), (5.0, 0.3)])
@pytest.mark.parametrize("num_heads, head_dim", [(6, 64), (16, 128)])
def test_sliding_windows_and_soft_cap(window: int, softcap: float, scale: float | None, num_heads: int,
                                      head_dim: int) -> None:
    """The windows' masks and the soft cap are softmax_rows', shared by both paths; scale 0.3 (not a
    power of two) multiplies the sums rather than q."""
    s = Step(num_heads, 2, head_dim, *STEPS["chunked"], seed=1)
    want = s.run(amx=False, window=window, softcap=softcap, scale=scale)
    assert_agrees(s.run(amx=True, window=window, softcap=softcap, scale=scale), want)
    if window in (1, 23):  # the window changes the result: the comparison is not vacuous
        assert (s.run(amx=False, softcap=softcap, scale=scale) - want).abs().max() > 0.1


@pytest.mark.parametrize("num_heads, head_dim", [(2, 64), (6, 64), (16, 128), (32, 256)])
def test_decode_kernel_matches_the_reference_passes(num_heads: int, head_dim: int) -> None:
    """paged_decode_attention (AMX tiles from kAmxAttentionMinRows query heads a kv head) against
    paged_attention's reference passes on the same decodes."""
    s = Step(num_heads, 2, head_dim, [1] * 6, [0, 15, 16, 31, 300, 777])
    out = torch.empty_like(s.q)
    md = s.metadata
    torch.ops.dabba_cpu.paged_decode_attention(out, s.q, s.key_cache, s.value_cache, md.block_table, md.seq_lens,
                                               head_dim ** -0.5)
    assert_agrees(out.float(), s.run(amx=False))


def test_amx_against_explicit_softmax() -> None:
    """The AMX path alone against the attention written out in float64 (q, keys, values as the bf16
    cache holds them), for a 600-token prompt after 130 tokens of context."""
    s = Step(6, 2, 64, [600], [130], seed=2)
    got = s.run(amx=True)
    table = torch.as_tensor(s.metadata.block_table[0])
    keys = s.key_cache.transpose(2, 3)[:, table].reshape(2, -1, 64)[:, :730].double()
    values = s.value_cache[:, table].reshape(2, -1, 64)[:, :730].double()
    q = s.q.double().view(600, 2, 3, 64)
    scores = torch.einsum("tkgd,knd->kgtn", q, keys) / 8
    causal = torch.arange(730)[None, :] > (130 + torch.arange(600))[:, None]
    expected = torch.einsum("kgtn,knd->tkgd", scores.masked_fill(causal, float("-inf")).softmax(-1), values)
    torch.testing.assert_close(got, expected.reshape(600, 6, 64).float(), atol=ATOL, rtol=RTOL)


def test_engine_greedy_matches_the_reference_backend(checkpoints) -> None:
    """End to end in bf16: the mistral checkpoint (head_dim 32, 4 query heads a kv head, a sliding
    window) attends on AMX tiles in the CPU backend; its greedy tokens equal the reference backend's."""
    from dabba import LLM, SamplingParams
    from tests.conftest import run_checked, token_prompts

    ckpt = checkpoints["mistral"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("torch_ref", "auto"):
        llm = LLM(str(ckpt.path), dtype="bfloat16", attention_backend=backend)
        outputs[backend] = [o.outputs[0].token_ids for o in run_checked(llm, token_prompts(ckpt.prompts), params)]
    assert type(llm.llm_engine.engine_core.model_runner.backend).__name__ == "CpuBackend"
    assert outputs["auto"] == outputs["torch_ref"]
