"""The worker-role side of the connector: this rank's native ``Producer`` (prefill) or
``Consumer`` (decode). It describes and registers the rank's KV cache, hands each step's
``KvxConnectorMetadata`` to the native side, and reports what it finished, what failed, and
what its counters grew by."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from kvx_vllm import _native
from kvx_vllm.compat import KVConnectorTransferResults
from kvx_vllm.config import KvxConfig, nixl_library, resolve_transport
from kvx_vllm.cpu_advice import cpu_attention_kernel, cpu_executor_advice
from kvx_vllm.groups import KvGroups
from kvx_vllm.layout import CacheDescription, describe, ordered_layers
from kvx_vllm.metadata import KvxConnectorMetadata, LayerSpec, RecvSpec
from kvx_vllm.resolve import Resolver
from kvx_vllm.stats import (
    FAILED_PREFIX,
    RAIL_PREFIX,
    STATS_COUNTERS,
    STATS_EVERY_S,
    STATS_GAUGES,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

# A child of vLLM's logger, so that it shares vLLM's handler and level.
logger = logging.getLogger("vllm.kvx")


def _granted(capability: str | None, prefill: str) -> tuple[str, str] | None:
    """A router's capability as the native consumer takes it: with the prefill address as the
    router wrote it (``kvx_prefill``, before any lookup), which the capability names."""
    return None if capability is None else (capability, prefill)


def _layer_index(kv_caches: dict[str, torch.Tensor], groups: KvGroups) -> dict[str, int]:
    """Prefill, layer-wise reports: the kvx layer (cache tensor) of each layer name whose save
    makes that tensor's share of kvx's first KV cache group final: every layer of a model of
    one group; the first group's layers of a hybrid model (the other groups' layers share the
    tensors, and their KV moves at the finish)."""
    layers = ordered_layers(kv_caches)
    if not groups.hybrid:
        return {name: i for i, (name, _) in enumerate(layers)}
    position = {t.data_ptr(): i for i, (_, t) in enumerate(layers)}
    return {
        name: position[t.data_ptr()]
        for name, t in kv_caches.items()
        if name in groups.first_layers
    }


class _Worker:
    """Worker-role state: this rank's native producer or consumer."""

    def __init__(self, vllm_config: VllmConfig, pull: bool, kv_cache_config: Any = None):
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.vllm_config = vllm_config
        self.pull = pull
        # A hybrid model's KV cache groups (kvx_vllm.groups); vLLM releases that give the
        # worker no KVCacheConfig run models of one group.
        self.groups = (
            KvGroups.from_config(kv_cache_config, vllm_config.cache_config.block_size)
            if kv_cache_config is not None
            else KvGroups.single()
        )
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
        self.gauges_reported: dict[str, int] = {f"gauge.{n}": 0 for n in STATS_GAUGES}
        self.stats_due = 0.0
        # Request spans go to an OpenTelemetry collector where one is named: the setting (a
        # bad one is an error), else OpenTelemetry's own variable (set for other programs too:
        # one kvx cannot use is passed over with a warning).
        service = "kvx-prefill" if self.is_producer else "kvx-decode"
        endpoint = self.cfg.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        try:
            _native.init_logging(self.cfg.log, otlp_endpoint=endpoint, service=service)
        except ValueError as e:
            if self.cfg.otlp_endpoint:
                raise
            _native.init_logging(self.cfg.log, service=service)
            logger.warning("kvx: request spans are not exported: %s", e)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        model = self.vllm_config.model_config
        tp_size = get_tensor_model_parallel_world_size()
        tp_rank = get_tensor_model_parallel_rank()
        block_size = self.vllm_config.cache_config.block_size
        mla = bool(getattr(model, "use_mla", False))
        self.cache = describe(
            kv_caches,
            head_size=model.get_head_size(),
            total_kv_heads=model.get_total_num_kv_heads(),
            block_size=block_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
            mode=self.cfg.layout,
            cpu_kernel=None if mla else cpu_attention_kernel(
                kv_caches, model.get_head_size(), block_size,
                self.vllm_config.cache_config.cache_dtype,
            ),
            mla=mla,
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
            cuda_device=cuda_device,
            nixl_library=nixl_library() if self.transport.startswith("nixl") else None,
            rails=self.cfg.rails,
            auth_key_file=self.cfg.key_file(),
            allow_unauthenticated=self.cfg.allow_unauthenticated,
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
                self.layer_index = _layer_index(kv_caches, self.groups)
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
        if self.groups.hybrid:
            logger.info(
                "kvx: %d KV cache groups; windows %s; group %d (full attention) first, the others "
                "at each request's finish",
                len(self.groups.order),
                list(self.groups.windows),
                self.groups.first_index,
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
            for tid, trace in meta.traces:
                self.producer.trace(tid, trace)
            self.layered = meta.layered if self.layer_index else []
            for tid in meta.aborts:
                self.producer.abort(tid)
            for p in meta.progress:
                self.producer.request_progress(p.transfer_id, p.block_ids, p.computed)
            for s in meta.sends:
                self.handed.add(s.request_id)
                finish = (
                    self.producer.request_finished_pull
                    if self.pull
                    else self.producer.request_finished
                )
                # A hybrid model's further groups only: a plain request's call stays plain.
                groups = {"groups": s.groups} if s.groups else {}
                finish(s.transfer_id, s.request_id, s.block_ids, s.num_tokens, **groups)
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
            for tid, prefill, capability in meta.abandons:
                # Only an address known without a lookup (an IP address, or a name looked up
                # for an earlier request): a lookup here would cost a thread, and a name no
                # request of this decode used leaves the KV to prefill's lease.
                addr = self.resolver.cached(prefill)
                if addr is None:
                    continue
                try:
                    self.consumer.abandon(tid, addr, capability=_granted(capability, prefill))
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
        request = (r.transfer_id, r.request_id, prefill, r.num_tokens, r.skip_tokens, r.block_ids)
        given: dict[str, Any] = {"capability": _granted(r.capability, r.prefill), "trace": r.trace}
        if r.groups:
            given["groups"] = r.groups
        if r.producer_block_ids is not None:
            if r.producer_groups:
                given["producer_groups"] = r.producer_groups
            self.consumer.pull(*request, r.producer_block_ids, **given)
        else:
            self.consumer.request_allocated(*request, **given)

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

    def stats_increments(self) -> dict[str, Any] | None:
        """What ``STATS_COUNTERS`` grew by since the last report, with the samples taken
        meanwhile (``STATS_SAMPLES``: push transfers on prefill, requests' waits for their KV on
        decode), at most every ``STATS_EVERY_S``; ``None`` in between, and when nothing moved."""
        now = time.monotonic()
        if now < self.stats_due:
            return None
        self.stats_due = now + STATS_EVERY_S
        current = self.stats()
        counters = [*STATS_COUNTERS, *(k for k in current if k.startswith(FAILED_PREFIX))]
        grown: dict[str, Any] = {
            name: current.get(name, 0) - self.stats_reported.get(name, 0) for name in counters
        }
        # Gauges: their values now, reported whenever one changed (or a counter grew).
        gauges = {f"gauge.{name}": current.get(name, 0) for name in STATS_GAUGES}
        gauges.update({RAIL_PREFIX + k[len("rail."):]: v
                       for k, v in current.items() if k.startswith("rail.")})
        gauges_moved = gauges != self.gauges_reported
        self.stats_reported = current
        self.gauges_reported = gauges
        samples = self.producer.take_transfer_samples() if self.producer is not None else []
        if samples:
            grown["transfer_seconds"] = [s for s, _ in samples]
            grown["transfer_bytes"] = [b for _, b in samples]
        waits = self.consumer.take_wait_samples() if self.consumer is not None else []
        if waits:
            grown["kv_wait_seconds"] = waits
        if not any(grown.values()) and not gauges_moved:
            return None
        grown.update(gauges)
        return grown

    def shutdown(self) -> None:
        for side in (self.producer, self.consumer):
            if side is not None:
                side.shutdown()
