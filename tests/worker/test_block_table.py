"""The worker's kept block tables: each step's gathered table equals one rebuilt from every
request's full list of block ids, through growth, appends, finishes, preemption and reuse of rows."""
from __future__ import annotations

import random

import numpy as np
import torch

from dabba.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from dabba.sampling_params import SamplingParams
from dabba.worker.block_table import BlockTables
from dabba.worker.request_states import RequestStates


def rebuilt(tables: dict[str, list[list[int]]], request_ids: list[str], group: int) -> np.ndarray:
    width = max(len(tables[r][group]) for r in request_ids)
    out = np.zeros((len(request_ids), width), np.int64)
    for i, r in enumerate(request_ids):
        out[i, : len(tables[r][group])] = tables[r][group]
    return out


def test_gathered_tables_equal_rebuilt_ones_under_random_traffic() -> None:
    rng = random.Random(0)
    kept, truth = BlockTables(), {}
    next_block, next_id = 1, 0
    for _ in range(400):
        op = rng.random()
        if op < 0.25 or not truth:  # a new request (or a resumed one, sent whole)
            request_id = rng.choice(list(truth)) if truth and rng.random() < 0.2 else f"r{next_id}"
            next_id += 1
            ids = [[next_block + i for i in range(rng.randint(1, 90))] for _ in range(2)]
            next_block += 200
            truth[request_id] = ids
            kept.add(request_id, tuple(list(g) for g in ids))
        elif op < 0.4:
            request_id = rng.choice(list(truth))
            del truth[request_id]
            kept.remove(request_id)
        else:
            request_id = rng.choice(list(truth))
            new = ([next_block] * rng.randint(0, 3), [next_block + 1] * rng.randint(0, 3))
            next_block += 2
            for g in range(2):
                truth[request_id][g] += new[g]
            kept.append(request_id, new)
        if truth:
            batch = rng.sample(list(truth), rng.randint(1, len(truth)))
            for g in range(2):
                np.testing.assert_array_equal(kept.gather(batch, g), rebuilt(truth, batch, g))
    assert len(kept.row_of) == len(truth) and kept.tables[0].shape[0] >= len(truth) > 0


def test_step_inputs_use_the_kept_tables() -> None:
    """Slot mapping and block table of a step, through RequestStates, from only the ids the
    scheduler sends (a table whole once, then appended ids)."""
    states = RequestStates()
    params = SamplingParams()
    new = [NewRequestData("a", list(range(20)), params, ([7, 3],), 0, 0),
           NewRequestData("b", list(range(5)), params, ([9],), 0, 0)]
    first = SchedulerOutput(scheduled_new_reqs=new, num_scheduled_tokens={"a": 20, "b": 5}, total_num_scheduled_tokens=25)
    states.update(first)
    inputs = states.prepare_inputs(first, 16, torch.device("cpu"))
    np.testing.assert_array_equal(inputs.attn[0].block_table, [[7, 3], [9, 0]])
    assert inputs.attn[0].slot_mapping.tolist() == [7 * 16 + i for i in range(16)] + [3 * 16 + i for i in range(4)] + \
        [9 * 16 + i for i in range(5)]
    for r, token in (("a", 1), ("b", 2)):
        states.states[r].token_ids.append(token)
    second = SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("b", ([4],), 5), CachedRequestData("a", ([],), 20)],
                             num_scheduled_tokens={"b": 1, "a": 1}, total_num_scheduled_tokens=2,
                             finished_req_ids=set())
    states.update(second)
    inputs = states.prepare_inputs(second, 16, torch.device("cpu"))
    np.testing.assert_array_equal(inputs.attn[0].block_table, [[9, 4], [7, 3]])
    assert inputs.attn[0].slot_mapping.tolist() == [9 * 16 + 5, 3 * 16 + 4]
