"""The scheduler-role side of the connector: turns vLLM's scheduling events into each step's
``KvxConnectorMetadata`` and keeps what is still in flight (prefill: the requests whose blocks
the producer holds, and the requests being computed, for streaming; decode: the requests
waiting for their KV). It reads the router's ``kv_transfer_params`` (the protocol is described
in :mod:`kvx_vllm.connector`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from kvx_vllm.config import KvxConfig
from kvx_vllm.groups import KvGroups, parse_groups
from kvx_vllm.metadata import KvxConnectorMetadata, LayerSpec, ProgressSpec, RecvSpec, SendSpec
from kvx_vllm.resolve import split

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger, so that it shares vLLM's handler and level.
logger = logging.getLogger("vllm.kvx")

_FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


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


def _transfer_id(params: dict[str, Any]) -> str:
    """The router's transfer id; ``ValueError`` when absent."""
    tid = params.get("kvx_transfer_id")
    if not tid:
        raise ValueError(
            "kv_transfer_params lack kvx_transfer_id "
            "(route requests through `kvx proxy`, or set it yourself)"
        )
    return str(tid)


def _trace(params: dict[str, Any] | None) -> str | None:
    """The request's W3C ``traceparent`` from the router (``kvx_trace``), if any: a value that
    is not a string is ignored (the native side ignores a malformed one)."""
    trace = (params or {}).get("kvx_trace")
    return trace if isinstance(trace, str) and trace else None


def _capability(params: dict[str, Any]) -> str | None:
    """The router's capability for the transfer (``kvx_capability``), if any; the native side
    checks it (a deployment key makes it required)."""
    capability = params.get("kvx_capability")
    if capability is not None and not isinstance(capability, str):
        raise ValueError(f"kvx_capability must be a string, not {type(capability).__name__}")
    return capability


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
        # A hybrid model's groups (full attention beside sliding window): see kvx_vllm.groups.
        self.groups = KvGroups.from_config(kv_cache_config, self.block_size)
        self.meta = KvxConnectorMetadata()
        # Prefill: requests whose blocks the producer holds (until finished_sending).
        self.held: set[str] = set()
        # Decode: requests waiting for their KV (until finished_recving), by transfer id.
        self.waiting: dict[str, str] = {}
        # Prefill, push, streaming: requests being computed.
        self.computing: dict[str, _Computing] = {}
        # A first group with a window loses blocks as it moves: nothing of it goes early.
        self.stream = self.cfg.stream and not pull and not self.groups.first_windowed
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
        trace = _trace(params)
        if trace is not None and params.get("do_remote_decode") and params.get("kvx_transfer_id"):
            # Prefill: its producer span starts before any of its writes.
            self.meta.traces.append((str(params["kvx_transfer_id"]), trace))
        if self.stream and params and params.get("do_remote_decode"):
            try:
                transfer_id = _transfer_id(params)
            except ValueError as e:
                # Not streamed; request_finished says the same and keeps its KV here.
                logger.warning("kvx: request %s: %s", request.request_id, e)
            else:
                # Not a hybrid model's: its further groups' blocks are known only at the finish.
                one_token = (
                    request.request_id
                    if self.cfg.seal
                    and getattr(request, "max_tokens", None) == 1
                    and not self.groups.hybrid
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
        per_group = blocks.get_block_ids()
        block_ids = self.groups.first(per_group)
        groups = self.groups.kept(per_group, self.block_size)
        # Tokens of decode's own prefix-cache hit: whole blocks, which the load skips.
        skip_tokens = request.num_prompt_tokens - num_external_tokens
        loads_from = skip_tokens // self.block_size
        try:
            transfer_id, prefill, producer_blocks, num_tokens = _recv_params(
                params, self.pull, request.num_prompt_tokens
            )
            _capability(params)
            producer_groups = None
            if self.pull and self.groups.hybrid:
                producer_groups = parse_groups(
                    params.get("kvx_remote_groups"), len(self.groups.order) - 1
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
                    block_ids=block_ids,
                    groups=groups,
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
                block_ids=block_ids,
                producer_block_ids=producer_blocks,
                groups=groups,
                producer_groups=producer_groups,
                loads_from=loads_from,
                capability=_capability(params),
                trace=_trace(params),
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
            capability = _capability(params)
        except ValueError:
            return  # nothing usable to name: its lease frees the KV
        self.meta.abandons.append((transfer_id, prefill, capability))

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
                c.block_ids = [int(b) for b in new.block_ids[self.groups.first_index]]
                c.pending = None
                self._layered(c, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            c = self.computing.get(rid)
            if c is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                c.block_ids = [int(b) for b in added[self.groups.first_index]] if added else []
                c.pending = None
                self._layered(c, cached.num_computed_tokens[i], scheduled.get(rid, 0))
                continue
            if added:
                c.block_ids.extend(int(b) for b in added[self.groups.first_index])
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
        """A model of one KV cache group (vLLM without its hybrid KV cache manager)."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, per_group: tuple[list[int], ...]
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
        block_ids = self.groups.first(per_group)
        if (request.status not in _FINISHED_OK and not sealed) or not block_ids:
            # Aborted (or nothing computed): a registration that arrived must fail now rather
            # than at the end of its lease.
            self.meta.aborts.append(transfer_id)
            return False, None
        num_tokens = request.num_computed_tokens
        groups = self.groups.kept(per_group, self.block_size)
        self.meta.sends.append(
            SendSpec(
                request_id=rid,
                transfer_id=transfer_id,
                block_ids=block_ids,
                num_tokens=num_tokens,
                groups=groups,
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
            out["kvx_remote_block_ids"] = block_ids
            if groups:
                out["kvx_remote_groups"] = [[first, ids] for first, ids in groups]
        return True, out

    def has_pending_work(self) -> bool:
        m = self.meta
        return bool(self.held or m.sends or m.recvs or m.aborts or m.cancels or m.abandons)
