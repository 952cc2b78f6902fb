"""Prompt lookup (n-gram) proposals: a request's next tokens guessed from its own text.

Text that copies or edits its prompt (code edits, summaries quoting a source, extraction) repeats
spans of it. If the last n tokens occurred earlier, what followed them then is a good guess for
what follows now. No model runs: the proposal is a search over the request's tokens.

The search is bytes.rfind over the token ids packed 4 bytes each, in C: the most recent earlier
occurrence of the longest n-gram (n from max_n down to min_n) whose match starts on a token
boundary. A request's packed ids grow by its new tokens each step; they are not repacked.

A match close to the end runs into the present: the text then repeats with the period between
the match and now, and the proposal goes on repeating it (a loop of one token proposes k of it),
as the tokens it proposes would themselves be looked up.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dabba.worker.spec_decode.proposer import Proposal

if TYPE_CHECKING:
    from dabba.core.kv_cache_groups import KVCacheGroup
    from dabba.core.outputs import SchedulerOutput
    from dabba.worker.request_states import RequestStates


@dataclass
class PackedTokens:
    """A request's token ids packed as int32 bytes, appended to as it grows."""

    ids: array = field(default_factory=lambda: array("i"))
    packed: bytearray = field(default_factory=bytearray)

    def sync(self, token_ids: list[int]) -> None:
        """Append what ``token_ids`` has beyond what is packed (token lists only ever grow)."""
        if len(token_ids) < len(self.ids):  # a request resent whole (resumed): start again
            self.ids, self.packed = array("i"), bytearray()
        new = array("i", token_ids[len(self.ids):])
        self.ids.extend(new)
        self.packed += new.tobytes()


@dataclass
class NgramProposer:
    num_tokens: int  # k: the most tokens proposed
    min_n: int
    max_n: int

    def bytes_per_block(self, block_size: int, kv_cache_dtype: str, groups: "tuple[KVCacheGroup, ...]") -> int:
        return 0  # it keeps no KV

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def propose(self, requests: "RequestStates", sched: "SchedulerOutput", sampled: list[str],
                wants: dict[str, int]) -> dict[str, Proposal]:
        """For each request in ``wants``, what followed the latest earlier occurrence of its text's end."""
        proposals = {}
        for request_id, limit in wants.items():
            state = requests.states[request_id]
            state.packed.sync(state.token_ids)
            draft = self.lookup(state.packed, limit)
            if draft:
                proposals[request_id] = Proposal(draft)
        return proposals

    def lookup(self, tokens: PackedTokens, limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of the longest
        suffix n-gram of ``tokens``; none if no n-gram of min_n or more tokens recurs."""
        count = min(self.num_tokens, limit)
        length = len(tokens.ids)
        if count < 1:
            return []
        data = tokens.packed
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = bytes(data[(length - n) * 4:])
            end = (length - 1) * 4  # a match must end before the last token: not the suffix itself
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # on a token boundary
                    return _continuation(tokens.ids, at // 4 + n, count)
                end = at + len(pattern) - 1  # a misaligned hit: look before it
        return []


def _continuation(ids: array, start: int, count: int) -> list[int]:
    """``count`` tokens from ``start`` on, past the end taken from the proposal itself."""
    out: list[int] = ids[start:start + count].tolist()
    while len(out) < count:
        out.append(out[start + len(out) - len(ids)])
    return out
