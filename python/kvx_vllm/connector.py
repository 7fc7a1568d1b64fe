"""vLLM connectors on top of the kvx connector (``kvx_vllm._native``).

Thin glue: the scheduler-role object turns vLLM's scheduling events into per-step metadata; the
worker-role object hands that metadata to the native ``Producer`` (prefill) or ``Consumer``
(decode) of its rank and reports what they finished. Matching of registrations with finished
requests, transfer planning, the writes, leases and heartbeats all run in Rust.

Protocol with the router (``kvx proxy``), through ``kv_transfer_params``:

* prefill leg: ``{"do_remote_decode": true, "kvx_transfer_id": T}``;
* decode leg, push: ``{"do_remote_prefill": true, "kvx_transfer_id": T, "kvx_prefill": ADDR}``
  where ADDR is the prefill instance's kvx control address (its ``listen`` key);
* decode leg, pull: the ``kv_transfer_params`` of prefill's response, which carry
  ``kvx_transfer_id``, ``kvx_prefill``, ``kvx_remote_block_ids`` and ``kvx_num_tokens``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # a vLLM before per-source hit metrics
    CacheHitSource = None  # type: ignore[assignment,misc]
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # a vLLM before connector stats
    KVConnectorStats = None  # type: ignore[assignment,misc]

from kvx_vllm import _native
from kvx_vllm.config import KvxConfig, resolve_transport
from kvx_vllm.layout import CacheDescription, describe, ordered_layers
from kvx_vllm.resolve import Resolver, split

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger, so that it shares vLLM's handler and level.
logger = logging.getLogger("vllm.kvx")

_FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)

# The native side's counters that vLLM logs with its own stats, as increments per interval.
STATS_COUNTERS = (
    "transfers_started",
    "transfers_ok",
    "transfers_failed",
    "bytes_written",
    "bytes_streamed",
)
# Seconds between two reads of the counters (vLLM asks every step).
STATS_EVERY_S = 1.0

if KVConnectorStats is not None:

    @dataclass
    class KvxConnectorStats(KVConnectorStats):
        """kvx's transfer counters (``STATS_COUNTERS``) over an interval, summed over ranks;
        vLLM logs them as "KV Transfer metrics"."""

        def reset(self) -> None:
            self.data = {}

        def aggregate(self, other: KVConnectorStats) -> KvxConnectorStats:
            for name, value in other.data.items():
                self.data[name] = self.data.get(name, 0) + value
            return self

        def reduce(self) -> dict[str, int | float]:
            return dict(self.data)

        def is_empty(self) -> bool:
            return not any(self.data.values())


@dataclass
class SendSpec:
    """Prefill: a finished request whose blocks the producer takes over."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int


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
class _Computing:
    """Prefill, push: a request being computed, as far as the workers have been told."""

    transfer_id: str
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    reported: int = 0
    # The computed-token count seen at the request's last scheduling that was not its first
    # (nor its first after a preemption), reported one step later under async scheduling.
    pending: int | None = None
    # Whether the workers were told to report steps of it layer by layer.
    layered: bool = False
    # The vLLM request, when it finishes with its first output token (a prefill for a remote
    # decode): the step computing its last prompt token is its last.
    one_token: str | None = None
    # The workers seal its KV at the end of this step's forward pass.
    sealed: bool = False


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
    # Set when the request's kv_transfer_params were unusable: its load fails at once.
    error: str | None = None
    # Index in ``block_ids`` of the first block the load writes: those before it hold decode's
    # own prefix-cache hit, which other requests may share.
    loads_from: int = 0

    @property
    def loaded_block_ids(self) -> list[int]:
        """The blocks this load writes: what a failed load reports to vLLM as load errors.
        Never the prefix-cache hit before them: vLLM would cut back, or fail under the `fail`
        policy, every other request sharing those blocks."""
        return self.block_ids[self.loads_from:]


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
    # Decode, push: (transfer id, prefill address) of requests that will never register
    # (aborted while queued, or nothing to load): prefill gives their KV back now instead of
    # at its lease.
    abandons: list[tuple[str, str]] = field(default_factory=list)

    def has_work(self) -> bool:
        return any(
            (self.sends, self.progress, self.layered, self.recvs, self.aborts, self.cancels,
             self.abandons)
        )


def _transfer_id(params: dict[str, Any]) -> str:
    """The router's transfer id; ``ValueError`` when absent."""
    tid = params.get("kvx_transfer_id")
    if not tid:
        raise ValueError(
            "kv_transfer_params lack kvx_transfer_id "
            "(route requests through `kvx proxy`, or set it yourself)"
        )
    return str(tid)


def _recv_params(
    params: dict[str, Any], pull: bool, prompt_tokens: int
) -> tuple[str, str, list[int] | None, int]:
    """Decode: the transfer id, the prefill's kvx address, (pull) prefill's block ids and the
    tokens to receive, checked; ``ValueError`` naming what is wrong. Any client can set
    ``kv_transfer_params``: a bad value fails its request's load, never the engine."""
    transfer_id = _transfer_id(params)
    prefill = params.get("kvx_prefill")
    if not isinstance(prefill, str) or not prefill:
        raise ValueError(f"kvx_prefill must be a HOST:PORT string, not {prefill!r}")
    try:
        split(prefill)
    except ValueError as e:
        raise ValueError(f"kvx_prefill must be HOST:PORT: {e}") from None
    if not pull:
        return transfer_id, prefill, None, prompt_tokens
    blocks = params.get("kvx_remote_block_ids")
    if not isinstance(blocks, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**32 for b in blocks
    ):
        raise ValueError("kvx_remote_block_ids must be a list of block ids (0 <= id < 2**32)")
    num_tokens = params.get("kvx_num_tokens", prompt_tokens)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ValueError(f"kvx_num_tokens must be a count of tokens, not {num_tokens!r}")
    if num_tokens < prompt_tokens - 1:
        # vLLM counts every prompt token but the last as loaded (it computes the last one to
        # sample from): KV for fewer would leave tokens that nobody wrote.
        raise ValueError(
            f"prefill computed {num_tokens} tokens of a {prompt_tokens}-token prompt "
            "(kvx_num_tokens): not the same prompt"
        )
    return transfer_id, prefill, list(blocks), min(prompt_tokens, num_tokens)


class _Scheduler:
    """Scheduler-role state: per-step metadata and what is still in flight."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, pull: bool):
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.pull = pull
        self.cfg = KvxConfig.from_extra(ktc.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise NotImplementedError(
                f"kvx_vllm supports models with one KV cache group; this one has {len(groups)}"
            )
        self.meta = KvxConnectorMetadata()
        # Prefill: requests whose blocks the producer holds (until finished_sending).
        self.held: set[str] = set()
        # Decode: requests waiting for their KV (until finished_recving), by transfer id.
        self.waiting: dict[str, str] = {}
        # Prefill, push, streaming: requests being computed.
        self.computing: dict[str, _Computing] = {}
        self.stream = self.cfg.stream and not pull
        # Unknown counts as on: the later, always-safe report.
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling is not False

    # -- decode side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if self.stream and params and params.get("do_remote_decode"):
            try:
                transfer_id = _transfer_id(params)
            except ValueError as e:
                # Not streamed; request_finished says the same and keeps its KV here.
                logger.warning("kvx: request %s: %s", request.request_id, e)
            else:
                one_token = (
                    request.request_id
                    if self.cfg.seal and getattr(request, "max_tokens", None) == 1
                    else None
                )
                self.computing.setdefault(
                    request.request_id,
                    _Computing(transfer_id, request.num_prompt_tokens, one_token=one_token),
                )
        if not params or not params.get("do_remote_prefill"):
            return
        # Only once: a re-entry (the second call after the load, or after a preemption) must
        # not register again.
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            # Nothing to load after all (vLLM computes the prompt here): prefill holds the KV
            # for nobody.
            self._abandon(params)
            return
        (block_ids,) = blocks.get_block_ids()
        # Tokens of decode's own prefix-cache hit: whole blocks, which the load skips.
        skip_tokens = request.num_prompt_tokens - num_external_tokens
        loads_from = skip_tokens // self.block_size
        try:
            transfer_id, prefill, producer_blocks, num_tokens = _recv_params(
                params, self.pull, request.num_prompt_tokens
            )
        except ValueError as e:
            # The worker reports the load failed, and vLLM fails or recomputes the request
            # per its kv_load_failure_policy.
            self.meta.recvs.append(
                RecvSpec(
                    request_id=request.request_id,
                    transfer_id="",
                    prefill="",
                    num_tokens=0,
                    skip_tokens=skip_tokens,
                    block_ids=list(block_ids),
                    error=f"bad kv_transfer_params: {e}",
                    loads_from=loads_from,
                )
            )
            return
        self.meta.recvs.append(
            RecvSpec(
                request_id=request.request_id,
                transfer_id=transfer_id,
                prefill=prefill,
                num_tokens=num_tokens,
                skip_tokens=skip_tokens,
                block_ids=list(block_ids),
                producer_block_ids=producer_blocks,
                loads_from=loads_from,
            )
        )
        self.waiting[request.request_id] = transfer_id

    def _abandon(self, params: dict[str, Any]) -> None:
        """Decode, push: a request that will never register; its prefill is told to give the
        KV back (the worker's `abandons`). Not in pull: there nobody registers before reading,
        so prefill could not tell this decode's drop from another decode's read in flight (a
        router that sent the same parameters to a second decode), and would free KV that is
        being read."""
        if self.pull:
            return
        try:
            transfer_id, prefill, _, _ = _recv_params(params, False, 0)
        except ValueError:
            return  # nothing usable to name: its lease frees the KV
        self.meta.abandons.append((transfer_id, prefill))

    # -- both ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvxConnectorMetadata:
        if self.computing:
            self._progress(scheduler_output)
        meta, self.meta = self.meta, KvxConnectorMetadata()
        if meta.has_work() and hasattr(scheduler_output, "has_sync_kv_loads"):
            # vLLM (0.32 on) runs `start_load_kv` after the step's forward pass unless a load
            # feeds that pass. Here it carries what must go out *before* it: finished requests'
            # writes (after the forward they would wait a whole step behind the next prefill),
            # registrations, and the progress and layer-by-layer reports of the requests this
            # very pass computes.
            scheduler_output.has_sync_kv_loads = True
        return meta

    def _progress(self, out: SchedulerOutput) -> None:
        """Prefill, push: which tokens of the requests being computed are final by the time
        the workers run this step, so that they can be written while it computes.

        * A request's count at its first scheduling (or its first after a preemption) is never
          used: it may include prefix-cache blocks that another request computes in this very
          step (vLLM caches blocks when it allocates them).
        * Later, the count at scheduling is what the request's earlier steps computed. With
          synchronous scheduling those steps have run when the workers start this one. With
          async scheduling this step is scheduled while the previous one still runs, so the
          count of the request's previous scheduling is used: the step before that has finished
          (vLLM keeps at most two steps in flight), also for a GPU whose kernels are
          asynchronous to the host.
        * A preempted request restarts in other blocks: the producer is told (no blocks, no
          tokens), so that it writes nothing more early and rewrites everything at the end.
        """
        for rid in out.preempted_req_ids or ():
            c = self.computing.get(rid)
            if c is not None:
                c.pending = None
                c.block_ids = []
                if c.reported or c.layered:
                    c.reported = 0
                    c.layered = False
                    self.meta.progress.append(ProgressSpec(c.transfer_id, [], 0))
        scheduled = getattr(out, "num_scheduled_tokens", None) or {}
        for new in out.scheduled_new_reqs:
            c = self.computing.get(new.req_id)
            if c is not None:
                c.block_ids = [int(b) for b in new.block_ids[0]]
                c.pending = None
                self._layered(c, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            c = self.computing.get(rid)
            if c is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                c.block_ids = [int(b) for b in added[0]] if added else []
                c.pending = None
                self._layered(c, cached.num_computed_tokens[i], scheduled.get(rid, 0))
                continue
            if added:
                c.block_ids.extend(int(b) for b in added[0])
            now = cached.num_computed_tokens[i]
            self._layered(c, now, scheduled.get(rid, 0))
            final = c.pending if self.async_scheduling else now
            c.pending = now
            if final is not None and c.reported < final < c.prompt_tokens:
                c.reported = final
                used = -(-final // self.block_size)
                self.meta.progress.append(
                    ProgressSpec(c.transfer_id, list(c.block_ids[:used]), final)
                )

    def _layered(self, c: _Computing, start: int, scheduled: int) -> None:
        """The request computes ``scheduled`` tokens from ``start`` in this step: the workers
        report them layer by layer (a host cache's forward pass is synchronous, so when vLLM
        saves a layer, that layer of every token of the step, and of every earlier step, is
        final, prefix-cache blocks that another request of this batch computes included)."""
        if scheduled <= 0:
            return
        end = min(start + scheduled, c.prompt_tokens)
        used = -(-end // self.block_size)
        if used <= len(c.block_ids):
            c.layered = True
            # Sealed only where nothing can come between this step and the request's finish:
            # with async scheduling an abort can (it is handled between the steps' halves).
            last = end == c.prompt_tokens and not self.async_scheduling
            c.sealed = last and c.one_token is not None
            self.meta.layered.append(
                LayerSpec(
                    c.transfer_id,
                    list(c.block_ids[:used]),
                    end,
                    seal_request=c.one_token if last else None,
                )
            )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self.held.discard(rid)
        for rid in output.finished_recving or ():
            self.waiting.pop(rid, None)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        rid = request.request_id
        computing = self.computing.pop(rid, None)
        if rid in self.waiting:
            # Decode: finished (aborted) while its KV is still coming. vLLM keeps the blocks
            # until the request shows up in finished_recving, which the cancel brings about.
            self.meta.cancels.append(self.waiting[rid])
            return False, None
        if params.get("do_remote_prefill") and not params.get("do_remote_decode"):
            # Decode: still set, so never allocated (update_state_after_alloc clears it): the
            # request was dropped while queued, and its prefill holds the KV for nobody.
            self._abandon(params)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        # Prefill.
        try:
            transfer_id = _transfer_id(params)
        except ValueError as e:
            logger.warning("kvx: request %s: %s; its KV stays here", rid, e)
            return False, None
        # A sealed request's KV is complete and may be on its way to decode: aborted after
        # the forward pass that sealed it (vLLM takes aborts that came during a step before it
        # finishes the step's requests), it is still sent, and its blocks are freed only once
        # nothing reads them.
        sealed = computing is not None and computing.sealed
        if (request.status not in _FINISHED_OK and not sealed) or not block_ids:
            # Aborted (or nothing computed): a registration that arrived must fail now rather
            # than at the end of its lease.
            self.meta.aborts.append(transfer_id)
            return False, None
        num_tokens = request.num_computed_tokens
        self.meta.sends.append(
            SendSpec(
                request_id=rid,
                transfer_id=transfer_id,
                block_ids=[int(b) for b in block_ids],
                num_tokens=num_tokens,
            )
        )
        self.held.add(rid)
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvx_transfer_id": transfer_id,
            "kvx_num_tokens": num_tokens,
        }
        if self.pull:
            out["kvx_prefill"] = self.cfg.listen
            out["kvx_remote_block_ids"] = [int(b) for b in block_ids]
        return True, out

    def has_pending_work(self) -> bool:
        m = self.meta
        return bool(self.held or m.sends or m.recvs or m.aborts or m.cancels or m.abandons)


class _Worker:
    """Worker-role state: this rank's native producer or consumer."""

    def __init__(self, vllm_config: VllmConfig, pull: bool):
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.vllm_config = vllm_config
        self.pull = pull
        self.cfg = KvxConfig.from_extra(ktc.kv_connector_extra_config)
        if ktc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(
                f"kvx_vllm needs kv_role kv_producer (prefill) or kv_consumer (decode), not {ktc.kv_role!r}"
            )
        self.is_producer = ktc.kv_role == "kv_producer"
        self.engine_id = str(ktc.engine_id)
        self.producer: Any = None
        self.consumer: Any = None
        self.cache: CacheDescription | None = None
        self.lock = threading.Lock()
        # Decode: the blocks the loads of requests waiting write, for
        # get_block_ids_with_load_errors.
        self.recv_blocks: dict[str, tuple[str, list[int]]] = {}
        # Decode: transfer id -> request id of requests waiting; request ids cancelled.
        self.recv_transfers: dict[str, str] = {}
        self.cancelled: set[str] = set()
        self.load_errors: set[int] = set()
        # Decode: requests refused before anything was sent (bad kv_transfer_params), with why.
        self.refused: list[tuple[str, str]] = []
        # Decode: prefill host names are looked up off this (the engine's) thread; requests
        # that name one wait here, with when they came, until the answer; requests cancelled
        # meanwhile are reported finished (not failed) at the next step.
        self.resolver = Resolver()
        self.resolving: list[tuple[RecvSpec, float]] = []
        self.dropped: list[str] = []
        # Prefill, push, host cache: the layer index of each cache's name, and this step's
        # requests to report layer by layer (empty otherwise).
        self.layer_index: dict[str, int] = {}
        self.layered: list[LayerSpec] = []
        # This step computes nothing (vLLM runs it for the connector alone); prefill: requests
        # handed to the producer whose end it has not reported yet.
        self.no_forward = False
        self.handed: set[str] = set()
        # The counters last reported to vLLM, and when they may be read next.
        self.stats_reported: dict[str, int] = {}
        self.stats_due = 0.0
        _native.init_logging(self.cfg.log)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        model = self.vllm_config.model_config
        tp_size = get_tensor_model_parallel_world_size()
        tp_rank = get_tensor_model_parallel_rank()
        block_size = self.vllm_config.cache_config.block_size
        self.cache = describe(
            kv_caches,
            head_size=model.get_head_size(),
            total_kv_heads=model.get_total_num_kv_heads(),
            block_size=block_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
            mode=self.cfg.layout,
            cpu_kernel=_cpu_attention_kernel(
                kv_caches, model.get_head_size(), block_size,
                self.vllm_config.cache_config.cache_dtype,
            ),
        )
        # `describe` checked that every layer's tensor is on one device.
        device = self.cache.tensors[0].device
        on_gpu = device.type == "cuda"
        cuda_device = (device.index or 0) if on_gpu else None
        self.transport = resolve_transport(self.cfg.transport, cuda_device)
        common = dict(
            transport=self.transport,
            token_unit=self.cache.token_unit,
            timings=self.cfg.timings(),
            max_entries=self.cfg.max_entries,
        )
        if self.is_producer:
            self.producer = _native.Producer(
                self.engine_id,
                self.cache.layout,
                self.cache.regions,
                listen=self.cfg.rank_listen(tp_rank),
                **common,
            )
            where = f"listening on {self.producer.control_addr}"
            if not self.pull and self.cfg.stream and not on_gpu:
                # Layer-wise reports need the layer's kernels to have finished when vLLM saves
                # it: true of the host (CPU) forward pass, not of a GPU's asynchronous one.
                self.layer_index = {
                    name: i for i, (name, _) in enumerate(ordered_layers(kv_caches))
                }
        else:
            self.consumer = _native.Consumer(
                self.engine_id, self.cache.layout, self.cache.regions, **common
            )
            where = "consumer"
        logger.info(
            "kvx %s rank %d/%d: %s layout %s (%d regions), %s over %s",
            "pull" if self.pull else "push",
            tp_rank,
            tp_size,
            self.cache.mode,
            self.cache.layout,
            len(self.cache.regions),
            where,
            self.transport,
        )
        if not on_gpu:
            executor = getattr(
                self.vllm_config.parallel_config, "distributed_executor_backend", None
            )
            push_consumer = self.consumer is not None and not self.pull
            for level, advice in cpu_executor_advice(executor, push_consumer, tp_size,
                                                     os.environ):
                logger.log(level, "kvx: %s", advice)

    def start_load_kv(self, meta: KvxConnectorMetadata, no_forward: bool = False) -> None:
        self.no_forward = no_forward
        if self.producer is not None:
            self.layered = meta.layered if self.layer_index else []
            for tid in meta.aborts:
                self.producer.abort(tid)
            for p in meta.progress:
                self.producer.request_progress(p.transfer_id, p.block_ids, p.computed)
            for s in meta.sends:
                self.handed.add(s.request_id)
                if self.pull:
                    self.producer.request_finished_pull(
                        s.transfer_id, s.request_id, s.block_ids, s.num_tokens
                    )
                else:
                    self.producer.request_finished(
                        s.transfer_id, s.request_id, s.block_ids, s.num_tokens
                    )
        if self.consumer is not None:
            for r in meta.recvs:
                if r.error is not None:
                    self._refuse(r, r.error)
                    continue
                with self.lock:
                    self.recv_blocks[r.request_id] = (r.transfer_id, r.loaded_block_ids)
                    self.recv_transfers[r.transfer_id] = r.request_id
                self._submit(r, time.monotonic())
            for tid in meta.cancels:
                held = next((x for x in self.resolving if x[0].transfer_id == tid), None)
                if held is not None:
                    # Cancelled while its prefill's name was looked up: nothing was sent.
                    self.resolving.remove(held)
                    self._forget(held[0])
                    with self.lock:
                        self.dropped.append(held[0].request_id)
                    continue
                with self.lock:
                    rid = self.recv_transfers.get(tid)
                    if rid is not None:
                        self.cancelled.add(rid)
                self.consumer.cancel(tid)
            for tid, prefill in meta.abandons:
                # Only an address known without a lookup (an IP address, or a name looked up
                # for an earlier request): a lookup here would cost a thread, and a name no
                # request of this decode used leaves the KV to prefill's lease.
                addr = self.resolver.cached(prefill)
                if addr is None:
                    continue
                try:
                    self.consumer.abandon(tid, addr)
                except ValueError as e:
                    logger.debug("kvx: not telling %s about dropped transfer %s: %s",
                                 prefill, tid, e)

    def _submit(self, r: RecvSpec, since: float) -> None:
        """Hands a request to the native consumer once its prefill's address is known (or
        refuses it); until then it waits in ``resolving``, at most ``connect_timeout_s``."""
        try:
            addr = self.resolver.address(r.prefill)
            if addr is None:
                if time.monotonic() - since < self.cfg.connect_timeout_s:
                    self.resolving.append((r, since))
                    return
                raise ValueError(
                    f"looking up {r.prefill} took over {self.cfg.connect_timeout_s:g} s"
                )
            self._receive(r, addr)
        except ValueError as e:
            # What cannot be sent (a name that does not resolve; what the native side refuses:
            # a bad port, a block id out of range) fails this request's load, not the engine.
            self._forget(r)
            self._refuse(r, str(e))

    def _forget(self, r: RecvSpec) -> None:
        """Drops a request that was never handed to the native consumer."""
        with self.lock:
            self.recv_blocks.pop(r.request_id, None)
            self.recv_transfers.pop(r.transfer_id, None)

    def _refuse(self, r: RecvSpec, error: str) -> None:
        with self.lock:
            self.refused.append((r.request_id, error))
            self.load_errors.update(r.loaded_block_ids)

    def _receive(self, r: RecvSpec, prefill: str) -> None:
        if r.producer_block_ids is not None:
            self.consumer.pull(
                r.transfer_id,
                r.request_id,
                prefill,
                r.num_tokens,
                r.skip_tokens,
                r.block_ids,
                r.producer_block_ids,
            )
        else:
            self.consumer.request_allocated(
                r.transfer_id, r.request_id, prefill, r.num_tokens, r.skip_tokens, r.block_ids
            )

    def save_kv_layer(self, layer_name: str) -> None:
        index = self.layer_index.get(layer_name)
        if index is None or index + 1 >= len(self.layer_index):
            # The last layer: the request's finish (or the next step's report) carries it.
            return
        for spec in self.layered:
            self.producer.request_progress(
                spec.transfer_id, spec.block_ids, spec.tokens, layers=index + 1
            )

    def wait_for_save(self) -> None:
        """The forward pass has ended: requests it computed to their end are sealed (their
        KV goes to decode now; vLLM hands their blocks over when it finishes them, at the end
        of this step)."""
        layered, self.layered = self.layered, []
        for spec in layered:
            if spec.seal_request is not None:
                self.producer.request_sealed(
                    spec.transfer_id, spec.seal_request, spec.block_ids, spec.tokens
                )

    def _idle_wait(self, awaited: bool) -> float:
        """How long this step may wait for a transfer to end: ``idle_wait_ms`` in a step vLLM
        runs only for the connector while ``awaited`` (a transfer can end), otherwise none.
        vLLM repeats such steps about every millisecond while a request waits for its KV
        (decode) or its blocks are held for one (prefill), and its engine and worker processes
        spin through them; a step that waits here returns as soon as a transfer ends."""
        return self.cfg.idle_wait_ms / 1e3 if self.no_forward and awaited else 0.0

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self.producer is not None:
            wait = self._idle_wait(bool(self.handed))
            for rid, sent, reason in self.producer.take_finished(wait_s=wait):
                if not sent:
                    logger.warning("kvx: KV of %s not delivered (%s); blocks freed", rid, reason)
                self.handed.discard(rid)
                results.finished_sending.add(rid)
        if self.consumer is not None:
            if self.resolving:
                waiting, self.resolving = self.resolving, []
                for r, since in waiting:
                    self._submit(r, since)
            with self.lock:
                refused, self.refused = self.refused, []
                dropped, self.dropped = self.dropped, []
            results.finished_recving.update(dropped)
            for rid, error in refused:
                logger.warning("kvx: KV of %s cannot be received: %s", rid, error)
                results.finished_recving.add(rid)
                results.failed_recving.add(rid)
            wait = self._idle_wait(
                bool(self.recv_blocks) and not self.resolving and not results.finished_recving
            )
            for rid, ok, reason, detail in self.consumer.take_events(wait_s=wait):
                results.finished_recving.add(rid)
                with self.lock:
                    tid, blocks = self.recv_blocks.pop(rid, ("", []))
                    self.recv_transfers.pop(tid, None)
                    if rid in self.cancelled:
                        # Aborted by vLLM itself: finished, not a load failure.
                        self.cancelled.discard(rid)
                        continue
                    if not ok:
                        self.load_errors.update(blocks)
                if not ok:
                    logger.warning("kvx: KV of %s did not arrive (%s) %s", rid, reason, detail)
                    results.failed_recving.add(rid)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self.lock:
            errors, self.load_errors = self.load_errors, set()
        return errors

    def stats(self) -> dict[str, int]:
        side = self.producer if self.producer is not None else self.consumer
        return dict(side.stats()) if side is not None else {}

    def stats_increments(self) -> dict[str, int] | None:
        """What ``STATS_COUNTERS`` grew by since the last report, at most every
        ``STATS_EVERY_S``; ``None`` in between, and when nothing moved."""
        now = time.monotonic()
        if now < self.stats_due:
            return None
        self.stats_due = now + STATS_EVERY_S
        current = self.stats()
        grown = {
            name: current.get(name, 0) - self.stats_reported.get(name, 0)
            for name in STATS_COUNTERS
        }
        self.stats_reported = current
        return grown if any(grown.values()) else None

    def shutdown(self) -> None:
        for side in (self.producer, self.consumer):
            if side is not None:
                side.shutdown()


class _KvxConnector(KVConnectorBase_V1):
    """Common part of the push and pull connectors."""

    _PULL = False
    if CacheHitSource is not None:
        # vLLM's metrics label the prompt tokens kvx brought as peer-to-peer hits.
        _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        _check_parallelism(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._sched: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _Scheduler(vllm_config, kv_cache_config, self._PULL)
        elif role == KVConnectorRole.WORKER:
            self._worker = _Worker(vllm_config, self._PULL)
        else:
            raise ValueError(f"unsupported connector role {role}")

    # -- scheduler role --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    # -- worker role -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxConnectorMetadata)
        # vLLM runs a step without a forward pass (attention metadata None) for the connector
        # alone, e.g. while requests wait for their KV.
        no_forward = getattr(forward_context, "attn_metadata", ...) is None
        self._worker.start_load_kv(meta, no_forward)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Requests are scheduled only once their whole KV has arrived: nothing to wait for.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Push with a host cache: this layer of the step's requests is final; the producer
        # writes it to decodes already registered while the next layers compute.
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> Any:
        if self._worker is None or KVConnectorStats is None:
            return None
        grown = self._worker.stats_increments()
        return None if grown is None else KvxConnectorStats(data=grown)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if KVConnectorStats is None:
            return None
        return KvxConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Head-major blocks (vLLM's ``HND``, ``LBHNC`` from 0.32 on): a rank's share of the
        heads is one run per block, and vLLM's CPU backend takes only this one. MLA caches hold
        one latent vector per token, where the order does not matter."""
        model = getattr(vllm_config, "model_config", None)
        if model is not None and getattr(model, "use_mla", False):
            return None
        return "HND"


# Variables that bind an OpenMP runtime's threads (GNU, Intel/LLVM, and the standard ones).
OMP_BINDING_VARS = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def cpu_executor_advice(executor: str | None, push_consumer: bool, tp_size: int,
                        environ: Mapping[str, str]) -> list[tuple[int, str]]:
    """What a rank on CPU logs at start about vLLM's executor, as (log level, message).

    Under `mp` a one-rank push decode is told that vLLM's engine-worker queue spins while
    requests wait for their KV, and that `uni` spares it. Under `uni` every rank is warned when
    nothing binds its OpenMP threads: vLLM 0.32 applies ``VLLM_CPU_OMP_THREADS_BIND`` only to
    the worker processes its `mp` executor starts, so under `uni` torch runs one unbound
    OpenMP thread per core of the machine, and instances sharing a machine slow each other
    down several times over whenever both compute."""
    advice = []
    if executor == "mp" and push_consumer and tp_size == 1:
        advice.append((logging.INFO, (
            "vLLM's mp executor on CPU spins on its engine-worker message queue while "
            "requests wait for their KV (about a core); VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "and --distributed-executor-backend uni run the worker in the engine core's "
            "process and spare that; bind its OpenMP threads then (kvx docs/vllm.md)"
        )))
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if (executor == "uni" and bind != "nobind"
            and not any(environ.get(v) for v in OMP_BINDING_VARS)):
        advice.append((logging.WARNING, (
            f"vLLM's uni executor on CPU does not apply VLLM_CPU_OMP_THREADS_BIND={bind}: "
            "its OpenMP threads, one per core, run unbound; set OMP_NUM_THREADS, OMP_PLACES "
            "and OMP_PROC_BIND=true for the engine as vLLM's mp executor does for its "
            "workers (kvx docs/vllm.md)"
        )))
    return advice


def _check_parallelism(vllm_config: VllmConfig) -> None:
    """Refuses, at start, the parallel layouts kvx does not pair: several pipeline stages (a
    rank's kvx port and its share of the layers follow its tensor-parallel rank only) and
    context parallelism (a request's blocks are split across ranks by token)."""
    parallel = vllm_config.parallel_config
    for name in (
        "pipeline_parallel_size",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ):
        size = getattr(parallel, name, 1)
        if size > 1:
            raise NotImplementedError(f"kvx_vllm does not support {name} > 1 (here {size})")


class KvxPushConnector(_KvxConnector):
    """Push: decode registers its blocks while prefill computes; prefill writes them."""

    _PULL = False


class KvxPullConnector(_KvxConnector):
    """Pull: prefill holds its blocks; decode reads them after prefill (for comparison)."""

    _PULL = True


def _cpu_attention_kernel(kv_caches: dict[str, torch.Tensor], head_size: int, block_size: int,
                          cache_dtype: str) -> str | None:
    """The kernel family vLLM's CPU attention backend uses for this cache (``vec``, ``vec16``,
    ``amx``, ``neon``, …), which decides how it lays out a block; ``None`` for a cache that is
    not on the CPU, or when this vLLM does not say (then kvx describes the cache block by
    block)."""
    first = next(iter(kv_caches.values()), None)
    if first is None or first.device.type != "cpu":
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    try:
        return str(_get_attn_isa(first.dtype, block_size, head_size, cache_dtype))
    except Exception:  # noqa: BLE001 - an unknown combination: describe block by block
        return None
