"""The scheduler glue's streaming reports, step by step, against scheduler outputs shaped like
vLLM's (`SchedulerOutput`'s fields the glue reads): which computed-token counts it reports as
final, with which blocks, and when it tells the producer to start over. The native side is
tested in test_native.py and end to end in test_e2e_vllm.py; this pins the rules of
`_Scheduler._progress`."""

from __future__ import annotations

import threading
from types import SimpleNamespace as NS

import pytest

from kvx_vllm.config import KvxConfig
from kvx_vllm.groups import KvGroups
from kvx_vllm.metadata import KvxConnectorMetadata, LayerSpec, ProgressSpec, SendSpec
from kvx_vllm.scheduler import _Computing, _Scheduler
from kvx_vllm.worker import _Worker

BLOCK = 16


def scheduler(async_scheduling: bool) -> _Scheduler:
    s = _Scheduler.__new__(_Scheduler)
    s.pull = False
    s.block_size = BLOCK
    s.groups = KvGroups.single()
    s.meta = KvxConnectorMetadata()
    s.held = set()
    s.waiting = {}
    s.computing = {"a": _Computing("t-a", prompt_tokens=100)}
    s.stream = True
    s.cfg = KvxConfig.from_extra({})
    s.async_scheduling = async_scheduling
    return s


def step(s: _Scheduler, *, new=None, cached=None, resumed=False, preempted=False, layered=None):
    """One scheduling of request "a": `new` = (blocks, computed) at its first scheduling,
    `cached` = (added blocks or None, computed) later. Returns the progress reported; the
    step's layer-wise specs go to `layered` when given (with 32 tokens scheduled)."""
    out = NS(
        scheduled_new_reqs=[NS(req_id="a", block_ids=(new[0],), num_computed_tokens=new[1])]
        if new else [],
        scheduled_cached_reqs=NS(
            req_ids=["a"] if cached else [],
            new_block_ids=[(cached[0],) if cached[0] is not None else None] if cached else [],
            num_computed_tokens=[cached[1]] if cached else [],
            resumed_req_ids={"a"} if resumed else set(),
        ),
        preempted_req_ids={"a"} if preempted else set(),
        num_scheduled_tokens={"a": 32} if (new or cached) and layered is not None else {},
    )
    meta = s.build_connector_meta(out)
    if layered is not None:
        layered.extend(meta.layered)
    return meta.progress


def test_sync_reports_what_earlier_steps_computed_never_the_first_count():
    s = scheduler(async_scheduling=False)
    # First scheduling with a prefix-cache hit of 48 tokens: those blocks may be computed by
    # another request in this very step, so nothing is reported.
    assert step(s, new=([1, 2, 3, 4], 48)) == []
    assert step(s, cached=([5], 80)) == [ProgressSpec("t-a", [1, 2, 3, 4, 5], 80)]
    # No new tokens, no new report.
    assert step(s, cached=(None, 80)) == []
    assert step(s, cached=([6], 96)) == [ProgressSpec("t-a", [1, 2, 3, 4, 5, 6], 96)]
    # The last token is never reported as progress (the finish carries it).
    assert step(s, cached=([7], 100)) == []


def test_async_reports_one_scheduling_later():
    s = scheduler(async_scheduling=True)
    assert step(s, new=([1, 2], 0)) == []
    assert step(s, cached=([3, 4], 32)) == []
    assert step(s, cached=([5, 6], 64)) == [ProgressSpec("t-a", [1, 2], 32)]
    assert step(s, cached=(None, 96)) == [ProgressSpec("t-a", [1, 2, 3, 4], 64)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_resets_and_the_resumed_request_starts_over(async_scheduling):
    s = scheduler(async_scheduling)
    step(s, new=([1, 2], 0))
    step(s, cached=([3, 4], 32))
    step(s, cached=([5, 6], 64))
    assert s.computing["a"].reported > 0
    # Preempted: the producer is told to forget what it wrote early.
    assert step(s, preempted=True) == [ProgressSpec("t-a", [], 0)]
    # Resumed in other blocks: that count is not used either.
    assert step(s, cached=([8, 9], 0), resumed=True) == []
    first_after = step(s, cached=([10, 11], 32))
    second_after = step(s, cached=(None, 64))
    reported = first_after + second_after
    assert reported and all(p.block_ids[:2] == [8, 9] for p in reported), reported


def test_finished_or_aborted_requests_are_forgotten():
    s = scheduler(async_scheduling=False)
    step(s, new=([1, 2], 0))
    request = NS(request_id="a", status=None,
                 kv_transfer_params={"do_remote_decode": True, "kvx_transfer_id": "t-a"})
    s.request_finished(request, [])
    assert "a" not in s.computing
    assert s.meta.aborts == ["t-a"]


def test_each_step_is_listed_for_layer_wise_reports_from_its_first_scheduling():
    s = scheduler(async_scheduling=True)
    layered: list[LayerSpec] = []
    # Unlike the step-wise counts, the first scheduling is listed: its layers are final when
    # vLLM saves them (the whole batch computes each layer together).
    step(s, new=([1, 2, 3, 4, 5], 48), layered=layered)
    assert layered == [LayerSpec("t-a", [1, 2, 3, 4, 5], 80)]
    layered.clear()
    # The step ends at the prompt's end (100 of 112).
    step(s, cached=([6, 7], 80), layered=layered)
    assert layered == [LayerSpec("t-a", [1, 2, 3, 4, 5, 6, 7], 100)]
    layered.clear()
    # Nothing scheduled for the request: nothing listed.
    step(s, cached=(None, 100))
    assert s.build_connector_meta(NS(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                 resumed_req_ids=set()),
        preempted_req_ids=set(),
    )).layered == []


class _Recorder:
    def __init__(self):
        self.calls = []

    def request_progress(self, transfer_id, block_ids, tokens, layers=None):
        self.calls.append((transfer_id, block_ids, tokens, layers))


def test_worker_reports_each_saved_layer_but_the_last():
    w = _Worker.__new__(_Worker)
    w.producer = _Recorder()
    w.layer_index = {"model.layers.0.attn": 0, "model.layers.1.attn": 1, "model.layers.2.attn": 2}
    w.layered = [LayerSpec("t-a", [1, 2], 20), LayerSpec("t-b", [3], 9)]
    for name in w.layer_index:
        w.save_kv_layer(name)
    w.save_kv_layer("model.layers.9.unknown")
    assert w.producer.calls == [
        ("t-a", [1, 2], 20, 1),
        ("t-b", [3], 9, 1),
        ("t-a", [1, 2], 20, 2),
        ("t-b", [3], 9, 2),
    ]


def test_preemption_after_layer_wise_reports_only_is_reported():
    s = scheduler(async_scheduling=True)
    layered: list[LayerSpec] = []
    step(s, new=([1, 2], 0), layered=layered)
    assert layered and s.computing["a"].reported == 0
    # Only layer-wise reports were made; the producer must still forget them.
    assert step(s, preempted=True) == [ProgressSpec("t-a", [], 0)]


def test_pending_push_work_lasts_while_blocks_are_held_or_metadata_is_unsent():
    """vLLM keeps a prefill engine stepping while `has_pending_push_work` is true: from the
    request's finish until the producer gave its blocks back (finished_sending)."""
    from vllm.v1.request import RequestStatus

    s = scheduler(async_scheduling=True)
    s.computing = {}
    assert not s.has_pending_work()
    request = NS(request_id="p", kv_transfer_params={"do_remote_decode": True,
                                                    "kvx_transfer_id": "t-p"},
                 status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    delay, params = s.request_finished(request, [1, 2, 3])
    assert delay and params["kvx_transfer_id"] == "t-p"
    assert s.has_pending_work(), "the send is not in the metadata yet"
    meta = s.build_connector_meta(NS(preempted_req_ids=set()))
    assert [x.transfer_id for x in meta.sends] == ["t-p"]
    assert s.has_pending_work(), "the producer still holds the blocks"
    s.update_connector_output(NS(finished_sending={"p"}, finished_recving=None))
    assert not s.has_pending_work()


def test_a_step_with_work_for_the_workers_has_it_done_before_its_forward_pass():
    """vLLM 0.32 runs `start_load_kv` after the forward pass unless the step has a load that
    feeds it: a step whose metadata carries anything (here a finished request's send, and
    the progress of a request this pass computes) asks for it before; an empty one changes
    nothing."""
    s = scheduler(async_scheduling=False)
    idle = NS(preempted_req_ids=set(), scheduled_new_reqs=[], has_sync_kv_loads=False,
              scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                       resumed_req_ids=set()))
    assert not s.build_connector_meta(idle).has_work()
    assert idle.has_sync_kv_loads is False
    s.meta.sends.append(SendSpec("b", "t-b", [7], 16))
    busy = NS(**{**vars(idle), "has_sync_kv_loads": False})
    assert s.build_connector_meta(busy).sends
    assert busy.has_sync_kv_loads is True
    layered = NS(**{**vars(idle), "has_sync_kv_loads": False,
                    "scheduled_new_reqs": [NS(req_id="a", block_ids=([1, 2],),
                                              num_computed_tokens=0)],
                    "num_scheduled_tokens": {"a": 32}})
    assert s.build_connector_meta(layered).layered
    assert layered.has_sync_kv_loads is True


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_step_that_ends_a_one_token_prefill_seals_it_with_synchronous_scheduling(
    async_scheduling,
):
    """A prefill for a remote decode (one output token) finishes in the step that computes
    its last prompt token: that step's spec names the request, so that the workers seal it
    when the forward pass ends. Not earlier steps, not a request that goes on generating,
    and not under async scheduling (an abort can come between the step and its finish)."""
    s = scheduler(async_scheduling)
    s.computing = {"a": _Computing("t-a", prompt_tokens=60, one_token="req-a")}
    layered: list[LayerSpec] = []
    step(s, new=([1, 2], 0), layered=layered)
    step(s, cached=([3, 4], 32), layered=layered)
    assert [x.seal_request for x in layered] == [None, None if async_scheduling else "req-a"]
    assert layered[1].tokens == 60 and layered[1].block_ids == [1, 2, 3, 4]
    s = scheduler(async_scheduling)
    s.computing = {"a": _Computing("t-a", prompt_tokens=30)}  # generates more tokens
    layered.clear()
    step(s, new=([1, 2], 0), layered=layered)
    assert [x.seal_request for x in layered] == [None]


def test_only_one_token_requests_for_a_remote_decode_are_marked():
    s = scheduler(async_scheduling=False)
    s.computing = {}
    params = {"do_remote_decode": True, "kvx_transfer_id": "t"}
    for rid, max_tokens in (("one", 1), ("more", 5)):
        s.update_state_after_alloc(
            NS(request_id=rid, kv_transfer_params=dict(params), num_prompt_tokens=40,
               max_tokens=max_tokens),
            None,
            0,
        )
    assert s.computing["one"].one_token == "one"
    assert s.computing["more"].one_token is None
    # Extra-config `seal` off: none is.
    s.cfg = KvxConfig.from_extra({"seal": False})
    s.update_state_after_alloc(
        NS(request_id="off", kv_transfer_params=dict(params), num_prompt_tokens=40,
           max_tokens=1),
        None,
        0,
    )
    assert s.computing["off"].one_token is None


class _Sealer:
    def __init__(self):
        self.sealed = []

    def request_sealed(self, transfer_id, request_id, block_ids, tokens):
        self.sealed.append((transfer_id, request_id, block_ids, tokens))


def test_worker_seals_at_the_end_of_the_forward_pass_once():
    w = _Worker.__new__(_Worker)
    w.producer = _Sealer()
    w.layered = [LayerSpec("t-a", [1, 2], 20, seal_request="req-a"), LayerSpec("t-b", [3], 9)]
    w.wait_for_save()
    w.wait_for_save()
    assert w.producer.sealed == [("t-a", "req-a", [1, 2], 20)]


def test_a_sealed_request_aborted_before_vllm_finished_it_is_still_sent():
    """vLLM handles aborts that came during a step before it finishes the step's requests: a
    request sealed in that step may be aborted instead of finishing. Its KV is complete and may
    be being written, so its blocks are handed over as for a finish (freed once nothing reads
    them), not freed at once; an aborted request that was not sealed is aborted."""
    from vllm.v1.request import RequestStatus

    s = scheduler(async_scheduling=False)
    s.computing = {"a": _Computing("t-a", prompt_tokens=30, one_token="a"),
                   "b": _Computing("t-b", prompt_tokens=300, one_token="b")}
    out = NS(
        scheduled_new_reqs=[NS(req_id=r, block_ids=(blocks,), num_computed_tokens=0)
                            for r, blocks in (("a", [1, 2]), ("b", [3, 4]))],
        scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                 resumed_req_ids=set()),
        preempted_req_ids=set(),
        num_scheduled_tokens={"a": 30, "b": 32},
    )
    assert [x.seal_request for x in s.build_connector_meta(out).layered] == ["a", None]
    for rid, blocks in (("a", [1, 2]), ("b", [3, 4])):
        request = NS(request_id=rid, status=RequestStatus.FINISHED_ABORTED,
                     num_computed_tokens=30 if rid == "a" else 32,
                     kv_transfer_params={"do_remote_decode": True, "kvx_transfer_id": f"t-{rid}"})
        delay, _ = s.request_finished(request, blocks)
        assert delay is (rid == "a")
    assert s.meta.sends == [SendSpec("a", "t-a", [1, 2], 30)]
    assert s.meta.aborts == ["t-b"]


class _Native:
    """A producer or consumer that records how long each step let it wait for a transfer to
    end, and hands out what `ended` holds."""

    def __init__(self):
        self.waits: list[float] = []
        self.ended: list[tuple] = []

    def request_finished(self, *args):
        pass

    def _take(self, wait_s: float) -> list[tuple]:
        self.waits.append(wait_s)
        ended, self.ended = self.ended, []
        return ended

    def take_finished(self, wait_s=0.0):
        return self._take(wait_s)

    def take_events(self, wait_s=0.0):
        return self._take(wait_s)


def idle_worker(extra: dict, producer=None, consumer=None) -> _Worker:
    w = _Worker.__new__(_Worker)
    w.cfg = KvxConfig.from_extra(extra)
    w.pull, w.producer, w.consumer = False, producer, consumer
    w.layer_index, w.layered, w.handed = {}, [], set()
    w.lock = threading.Lock()
    w.recv_blocks, w.recv_transfers, w.cancelled, w.load_errors = {}, {}, set(), set()
    w.refused, w.resolving, w.dropped = [], [], []
    return w


def test_prefill_waits_in_a_step_without_a_forward_pass_while_a_request_is_handed_over():
    """vLLM repeats steps without a forward pass while prefill holds blocks for a decode: such
    a step waits (`idle_wait_ms`, 2 by default) for a handed-over request to end; a step with a
    forward pass, or one with nothing handed over, never waits."""
    native = _Native()
    w = idle_worker({}, producer=native)
    send = KvxConnectorMetadata(sends=[SendSpec("a", "t-a", [1, 2], 30)])
    for meta, no_forward, ended in (
        (KvxConnectorMetadata(), True, []),  # nothing handed over
        (send, False, []),  # a forward pass
        (KvxConnectorMetadata(), True, [("a", True, "")]),  # waits; "a" is sent meanwhile
        (KvxConnectorMetadata(), True, []),  # nothing left
    ):
        w.start_load_kv(meta, no_forward)
        native.ended = ended
        assert w.get_transfer_results().finished_sending == {r for r, _, _ in ended}
    assert native.waits == [0.0, 0.0, 0.002, 0.0]


def test_decode_waits_in_a_step_without_a_forward_pass_while_a_request_waits_for_its_kv():
    native = _Native()
    w = idle_worker({}, consumer=native)
    w.recv_blocks = {"r": ("t-r", [5])}
    w.recv_transfers = {"t-r": "r"}
    w.start_load_kv(KvxConnectorMetadata(), no_forward=False)
    assert w.get_transfer_results().finished_recving == set()
    w.start_load_kv(KvxConnectorMetadata(), no_forward=True)
    native.ended = [("r", True, "", "")]
    assert w.get_transfer_results().finished_recving == {"r"}
    # Nothing waits any more; then a refused request to report: no wait either.
    w.start_load_kv(KvxConnectorMetadata(), no_forward=True)
    w.get_transfer_results()
    w.recv_blocks = {"s": ("t-s", [6])}
    w.refused = [("q", "bad kv_transfer_params")]
    w.start_load_kv(KvxConnectorMetadata(), no_forward=True)
    assert w.get_transfer_results().failed_recving == {"q"}
    assert native.waits == [0.0, 0.002, 0.0, 0.0]


def test_idle_wait_ms_zero_never_waits_and_out_of_range_values_are_refused():
    native = _Native()
    w = idle_worker({"idle_wait_ms": 0}, consumer=native)
    w.recv_blocks = {"r": ("t-r", [5])}
    w.start_load_kv(KvxConnectorMetadata(), no_forward=True)
    w.get_transfer_results()
    assert native.waits == [0.0]
    for bad in (-1, 101, "soon"):
        with pytest.raises(ValueError):
            KvxConfig.from_extra({"idle_wait_ms": bad})
