"""benchmarks/bytes_touched.py: the pages a decode step touches, from the page tables' accessed bits.
A mixture of experts must touch its active experts' pages and not the others'."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.bytes_touched import CLEAR_REFS, expected_bytes
from dabba.arch.config import ArchConfig
from tools.tiny_checkpoint import make_checkpoint

pytestmark = pytest.mark.skipif(not CLEAR_REFS.exists(), reason="needs Linux's /proc/self/clear_refs")

# 64 experts of 512 (3/4 MiB each in bf16), 2 per token: the idle experts' 46 MiB a layer dwarf
# everything else a step touches (about 10 MiB of the interpreter's and PyTorch's own pages)
MOE = dict(num_experts=64, num_experts_per_tok=2, intermediate_size=512, hidden_size=256, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("wide-moe"), "OlmoeForCausalLM", dtype="bfloat16", **MOE)


# The kernel may clear accessed bits on its own (page aging, multi-gen LRU's walks) between a call
# and the count, so a count can fall short of what the call read; and a page's referenced flag is
# shared with every process mapping it (libtorch's pages, say), so a busy machine can add to a count.
# The lower bounds below take the largest of five counts, the upper bounds the smallest.
def test_touched_by_counts_the_pages_a_call_reads() -> None:
    code = """
import json, torch
from benchmarks.bytes_touched import disable_huge_pages, touched_by
disable_huge_pages()
x = torch.ones(64 * 2**20 // 4)
quarter = x[: x.numel() // 4]
print(json.dumps([[touched_by(lambda: quarter.sum()) for _ in range(5)],
                  [touched_by(lambda: x.sum()) for _ in range(5)]]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    quarter, whole = json.loads(out.stdout)
    assert max(quarter) >= 16 * 2**20 and min(quarter) < 24 * 2**20  # 16 MiB read, plus the interpreter's pages
    assert max(whole) >= 64 * 2**20 and min(whole) < 72 * 2**20


def test_expected_bytes_count_the_experts_a_token_takes(wide_moe) -> None:
    expected = expected_bytes(str(wide_moe), None)
    arch = ArchConfig.from_hf(wide_moe)
    expert = 3 * arch.hidden_size * arch.moe.intermediate_size * torch.bfloat16.itemsize
    assert expected["all_weights"] - expected["active_weights"] == 2 * 62 * expert  # 62 idle experts, 2 layers


def test_a_decode_step_touches_only_the_chosen_experts(wide_moe) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bytes_touched", "--model", str(wide_moe), "--steps", "3"],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    assert r["layer_loop"] == "native" and len(r["touched_mib_per_step"]) == 3
    assert max(r["touched_mib_per_step"]) >= r["active_weights_mib"]  # what a step must read, it touched
    assert r["touched_mib_median"] < 0.3 * r["all_weights_mib"]  # and not the 124 idle experts
