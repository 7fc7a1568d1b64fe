"""What the scheduler-role connector tells the workers each step (``KvxConnectorMetadata``),
and the per-request specs it carries."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvx_vllm.groups import NULL_BLOCK


@dataclass
class SendSpec:
    """Prefill: a finished request whose blocks the producer takes over."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    # A hybrid model's further KV cache groups: (first token kept, block ids) each.
    groups: list[tuple[int, list[int]]] = field(default_factory=list)


@dataclass
class ProgressSpec:
    """Prefill, push: a request still computing whose first ``computed`` tokens are final."""

    transfer_id: str
    block_ids: list[int]
    computed: int


@dataclass
class LayerSpec:
    """Prefill, push: a request computed in this step, up to ``tokens``. On a host cache (whose
    forward pass runs synchronously) each layer's KV of those tokens is final once vLLM calls
    ``save_kv_layer`` for it, and the workers report it then."""

    transfer_id: str
    block_ids: list[int]
    tokens: int
    # Set when this step computes the request's last prompt token and vLLM will finish the
    # request in it (its one output token): at the end of the forward pass its KV is complete,
    # and the workers seal it then, a whole engine iteration before `request_finished`.
    seal_request: str | None = None


@dataclass
class RecvSpec:
    """Decode: a request whose KV is to arrive (push) or be read (pull) into ``block_ids``."""

    request_id: str
    transfer_id: str
    prefill: str
    num_tokens: int
    skip_tokens: int
    block_ids: list[int]
    producer_block_ids: list[int] | None = None
    # A hybrid model's further KV cache groups: (first token kept, block ids) each, and
    # (pull) prefill's, (first token kept, block ids) each.
    groups: list[tuple[int, list[int]]] = field(default_factory=list)
    producer_groups: list[tuple[int, list[int]]] | None = None
    # Set when the request's kv_transfer_params were unusable: its load fails at once.
    error: str | None = None
    # Index in ``block_ids`` of the first block the load writes: those before it hold decode's
    # own prefix-cache hit, which other requests may share.
    loads_from: int = 0
    # The router's capability for the transfer (``kvx_capability``), if it gave one.
    capability: str | None = None
    # The request's W3C ``traceparent`` (``kvx_trace``), if the router gave one.
    trace: str | None = None

    @property
    def loaded_block_ids(self) -> list[int]:
        """The blocks this load writes, in every KV cache group: what a failed load reports to
        vLLM as load errors. Never the prefix-cache hit before them (vLLM would cut back, or
        fail under the `fail` policy, every other request sharing those blocks), nor vLLM's
        null block (id 0), which a sliding-window group holds for the tokens before its window
        (also a model's only group, where every layer has a window)."""
        out = [b for b in self.block_ids[self.loads_from:] if b != NULL_BLOCK]
        for _, ids in self.groups:
            out += [b for b in ids[self.loads_from:] if b != NULL_BLOCK]
        return out


@dataclass
class KvxConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers each step."""

    sends: list[SendSpec] = field(default_factory=list)
    # Prefill, push: requests still computing, with what of them is final.
    progress: list[ProgressSpec] = field(default_factory=list)
    # Prefill, push: requests computed in this step, reported layer by layer as they compute.
    layered: list[LayerSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    # Prefill: transfers to abort (the request was aborted before it finished).
    aborts: list[str] = field(default_factory=list)
    # Decode: transfers to give up (the request was aborted while waiting for its KV).
    cancels: list[str] = field(default_factory=list)
    # Decode, push: (transfer id, prefill address, capability) of requests that will never
    # register (aborted while queued, or nothing to load): prefill gives their KV back now
    # instead of at its lease.
    abandons: list[tuple[str, str, str | None]] = field(default_factory=list)
    # Prefill: (transfer id, traceparent) of requests the router traces (``kvx_trace``), told
    # to the producer before anything else of theirs.
    traces: list[tuple[str, str]] = field(default_factory=list)

    def has_work(self) -> bool:
        return any(
            (self.sends, self.progress, self.layered, self.recvs, self.aborts, self.cancels,
             self.abandons, self.traces)
        )
