"""vLLM connectors on top of the kvx connector (``kvx_vllm._native``): the classes vLLM loads.

Thin glue: the scheduler-role object turns vLLM's scheduling events into per-step metadata; the
worker-role object hands that metadata to the native ``Producer`` (prefill) or ``Consumer``
(decode) of its rank and reports what they finished. Matching of registrations with finished
requests, transfer planning, the writes, leases and heartbeats all run in Rust.

The package, by role:

* :mod:`kvx_vllm.connector` (here): ``KvxPushConnector`` and ``KvxPullConnector``, which vLLM
  loads and which pass each call to the side of their role;
* :mod:`kvx_vllm.scheduler`: the scheduler-role side, and the checks of ``kv_transfer_params``;
* :mod:`kvx_vllm.worker`: the worker-role side, around this rank's native producer or consumer;
* :mod:`kvx_vllm.metadata`: what the scheduler tells the workers each step;
* :mod:`kvx_vllm.groups`: a hybrid model's KV cache groups (full attention beside sliding
  window), as kvx moves them;
* :mod:`kvx_vllm.stats`: kvx's counters in vLLM's connector stats;
* :mod:`kvx_vllm.cpu_advice`: the start-up advice on CPU, and vLLM's CPU attention kernel.

Protocol with the router (``kvx proxy``), through ``kv_transfer_params``:

* prefill leg: ``{"do_remote_decode": true, "kvx_transfer_id": T}``;
* decode leg, push: ``{"do_remote_prefill": true, "kvx_transfer_id": T, "kvx_prefill": ADDR}``
  where ADDR is the prefill instance's kvx control address (its ``listen`` key);
* decode leg, pull: the ``kv_transfer_params`` of prefill's response, which carry
  ``kvx_transfer_id``, ``kvx_prefill``, ``kvx_remote_block_ids`` and ``kvx_num_tokens``
  (and, for a hybrid model, ``kvx_remote_groups``: ``[first_token, block ids]`` per further
  group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # a vLLM before per-source hit metrics
    CacheHitSource = None  # type: ignore[assignment,misc]

from kvx_vllm.compat import KVConnectorTransferResults
from kvx_vllm.metadata import KvxConnectorMetadata
from kvx_vllm.scheduler import _Scheduler
from kvx_vllm.stats import KVConnectorStats
from kvx_vllm.worker import _Worker

if KVConnectorStats is not None:
    from kvx_vllm.stats import KvxConnectorStats
try:
    from kvx_vllm.stats import KvxPromMetrics
except ImportError:  # a vLLM before connector Prometheus metrics
    KvxPromMetrics = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class _KvxConnector(KVConnectorBase_V1, SupportsHMA):
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
            self._worker = _Worker(vllm_config, self._PULL, kv_cache_config)
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

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A hybrid model's request (several KV cache groups, vLLM's hybrid KV cache manager):
        see :mod:`kvx_vllm.groups`."""
        assert self._sched is not None
        return self._sched.request_finished_all_groups(request, block_ids)

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

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """kvx's counters on vLLM's ``/metrics`` (``KvxPromMetrics``)."""
        if KvxPromMetrics is None:
            return None
        return KvxPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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
