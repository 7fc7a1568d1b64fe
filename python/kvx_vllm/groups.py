"""A hybrid model's KV cache groups (vLLM's hybrid KV cache manager), as kvx moves them.

vLLM gives each kind of attention layer a group with blocks of its own: full attention beside
sliding window, say. On the host (and on GPUs with uniform pages) one layer of every group
shares each cache tensor, so a group's block ids index the same tensors as every other group's;
the worker's caches are described once and each group moves through every one of them.

kvx's first group is the first full-attention group (vLLM keeps its blocks until the request
ends, so its tokens may be written early, while prefill computes); the others follow in vLLM's
order and move when the request finishes. A model without full-attention layers (every group
windowed, or its one group) moves everything at the finish. A sliding-window group holds vLLM's
null block (id 0) for the tokens that left its window (vLLM's allocator keeps the blocks from
token ``N - W + 1`` of an ``N``-token prompt and window ``W``, on both sides): each side keeps
the group from its first real block, and kvx moves the tokens both keep. A group of another
kind (Mamba state, chunked local attention, cross attention) is refused at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

#: Groups whose blocks hold every token of a request until it ends.
_WHOLE = ("FullAttentionSpec", "MLAAttentionSpec")
#: Groups whose blocks hold the tokens of a sliding window (null blocks before it).
_WINDOWED = ("SlidingWindowSpec", "SlidingWindowMLASpec")

#: vLLM's null block: a placeholder for tokens a group does not keep.
NULL_BLOCK = 0

#: A further group's blocks as the native side takes them: the first token it keeps, and its
#: block ids from token 0.
Group = tuple[int, list[int]]


@dataclass(frozen=True)
class KvGroups:
    """The KV cache groups of a model, in the order kvx moves them."""

    #: vLLM's group indices, kvx's first group first.
    order: tuple[int, ...]
    #: Per vLLM group: its sliding window in tokens, or ``None`` (every token kept).
    windows: tuple[int | None, ...]
    #: The layer names of kvx's first group.
    first_layers: frozenset[str]

    @classmethod
    def single(cls) -> KvGroups:
        """A model of one group (no configuration to read)."""
        return cls(order=(0,), windows=(None,), first_layers=frozenset())

    @classmethod
    def from_config(cls, kv_cache_config: Any, block_size: int) -> KvGroups:
        """Reads vLLM's ``KVCacheConfig``; ``NotImplementedError`` for a group kvx cannot move."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if not groups:
            return cls.single()
        # One group of any kind moves as before; several must each be one kvx can move.
        windows = [_window(g, i, block_size, len(groups) > 1) for i, g in enumerate(groups)]
        first = next((i for i, w in enumerate(windows) if w is None), 0)
        order = (first, *(i for i in range(len(groups)) if i != first))
        return cls(
            order=order, windows=tuple(windows), first_layers=frozenset(groups[first].layer_names)
        )

    @property
    def hybrid(self) -> bool:
        """Whether the model has further groups beside the first."""
        return len(self.order) > 1

    @property
    def first_windowed(self) -> bool:
        """Whether kvx's first group has a window too (a model with no full-attention layer):
        vLLM then frees its blocks as the window moves, under writes made while the request
        computes, so it moves only when the request finishes."""
        return self.windows[self.first_index] is not None

    @property
    def first_index(self) -> int:
        """vLLM's index of kvx's first group."""
        return self.order[0]

    def first(self, block_ids: Sequence[Sequence[int]]) -> list[int]:
        """The first group's block ids out of vLLM's per-group tuple."""
        return [int(b) for b in block_ids[self.first_index]]

    def kept(self, block_ids: Sequence[Sequence[int]], block_size: int) -> list[Group]:
        """The further groups of a request, each kept from its first block that is not vLLM's
        null block (prefill: what its window still holds at the finish; decode: what its
        allocator gave real blocks). kvx moves the tokens that both sides keep."""
        out = []
        for index in self.order[1:]:
            ids = [int(b) for b in block_ids[index]]
            out.append((_leading_nulls(ids) * block_size if self.windows[index] else 0, ids))
        return out


def _window(group: Any, index: int, block_size: int, hybrid: bool) -> int | None:
    """A group's sliding window (``None``: it keeps every token). In a hybrid model, a group of
    another kind or block size is refused (``NotImplementedError``)."""
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    if kind in _WINDOWED:
        window: int | None = int(spec.sliding_window)
    elif kind in _WHOLE or not hybrid:
        window = None
    else:
        raise NotImplementedError(
            f"kvx_vllm moves full-attention and sliding-window KV cache groups; group "
            f"{index} is a {kind} (layers {', '.join(group.layer_names[:4])}...)"
        )
    if hybrid and getattr(spec, "block_size", block_size) != block_size:
        raise NotImplementedError(
            f"KV cache group {index} has blocks of {spec.block_size} tokens, the cache "
            f"{block_size}: kvx_vllm needs one block size"
        )
    return window


def _leading_nulls(ids: list[int]) -> int:
    """How many of ``ids`` lead with vLLM's null block."""
    count = 0
    for b in ids:
        if b != NULL_BLOCK:
            break
        count += 1
    return count


def parse_groups(value: Any, count: int) -> list[Group]:
    """Prefill's further groups as the router relayed them (``kvx_remote_groups``: a list of
    ``[first_token, [block ids]]``), checked; ``ValueError`` naming what is wrong."""
    if not isinstance(value, list) or len(value) != count:
        raise ValueError(
            f"kvx_remote_groups must list {count} groups of [first_token, block ids]"
        )
    out = []
    for item in value:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise ValueError("each of kvx_remote_groups must be [first_token, block ids]")
        first, ids = item
        if not _is_count(first) or not isinstance(ids, list) or not all(
            _is_count(b) and b < 2**32 for b in ids
        ):
            raise ValueError("kvx_remote_groups holds a bad first token or block id")
        out.append((first, list(ids)))
    return out


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
