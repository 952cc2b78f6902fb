"""How checkpoint tensors' names meet dabba's merged layers: q/k/v into one qkv_proj, gate/up into
one gate_up_proj. The models load by it (each tensor to its merged parameter and shard), and a
checkpoint's per-tensor facts (a GGUF file's type per tensor) reach each merged layer by it."""
from __future__ import annotations

from typing import Hashable

# checkpoint name fragment -> (merged parameter fragment, shard id)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def checkpoint_target(name: str) -> tuple[str, Hashable]:
    """A checkpoint tensor's parameter name and shard id (q_proj -> qkv_proj, "q"; None if unmerged)."""
    for fragment, (merged, sid) in STACKED_PARAMS.items():
        if fragment in name:
            return name.replace(fragment, merged), sid
    return name, None


def shard_checkpoint_names(prefix: str, shard_ids: tuple | None) -> list[str]:
    """A layer's checkpoint module names, one per merged shard (``prefix`` itself when unmerged):
    "model.layers.0.self_attn.qkv_proj" with ("q", "k", "v") -> its q_proj, k_proj and v_proj."""
    if not shard_ids:
        return [prefix]
    dotted = prefix + "."
    names = []
    for sid in shard_ids:
        fragment = next((f for f, (merged, s) in STACKED_PARAMS.items() if s == sid and dotted.endswith(merged)), None)
        if fragment is None:
            raise ValueError(f"{prefix}: no checkpoint name for shard {sid!r}")
        names.append(dotted[:-len(STACKED_PARAMS[fragment][0])] + fragment[:-1])
    return names
