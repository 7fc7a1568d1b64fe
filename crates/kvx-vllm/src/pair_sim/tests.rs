//! Transfers between a prefill and a decode instance, step by step: what each side decides at
//! the instant it is due, and the KV that lands.

use kvx_rendezvous::Reason;

use super::*;
use crate::producer::SendOutcome;
use crate::sim_support::{ids, key};

fn ms(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// Asserts that decode's engine heard exactly that `key` failed for `reason`, and returns
/// the failure's detail.
fn expect_failed(pair: &Pair, key: AttemptKey, reason: Reason) -> String {
    match &pair.events()[..] {
        [RecvEvent::Failed {
            key: failed,
            reason: r,
            detail,
            ..
        }] if *failed == key && *r == reason => detail.clone(),
        other => panic!("expected {key} to fail for {reason:?}, got {other:?}"),
    }
}

/// Asserts that decode's engine heard exactly that `key` is ready.
fn expect_ready(pair: &Pair, key: AttemptKey) {
    assert_eq!(
        pair.events(),
        vec![RecvEvent::Ready {
            key,
            request: DECODE_REQUEST
        }]
    );
}

/// Asserts that prefill's engine heard exactly that `key`'s blocks are free, with `outcome`.
fn expect_given_back(pair: &Pair, key: AttemptKey, outcome: SendOutcome) {
    assert_eq!(
        pair.finished(),
        vec![FinishedSending {
            request: PREFILL_REQUEST,
            key,
            outcome
        }]
    );
}

/// A registration that prefill never serves fails at its lease, to the nanosecond; a finish
/// that comes for it afterwards is given back at once, unsent.
#[test]
fn a_registration_prefill_never_serves_fails_at_its_lease_and_a_late_finish_goes_back_at_once() {
    let mut pair = Pair::new(ms(300));
    pair.register(key(1), 8, ids(0..2));
    pair.at(ms(300) - Duration::from_nanos(1));
    assert_eq!(pair.events(), vec![]);
    pair.at(ms(300));
    expect_failed(&pair, key(1), Reason::LeaseExpired);
    assert_eq!(pair.decode_held(), 0);
    pair.finish(key(1), 8, ids(0..2));
    assert!(matches!(
        &pair.finished()[..],
        [FinishedSending { key: k, outcome: SendOutcome::NotSent(_), .. }] if *k == key(1)
    ));
    assert_eq!(pair.prefill_held(), 0);
}

/// Prefill's engine aborts a transfer decode waits for: decode fails it at once.
#[test]
fn prefills_abort_fails_the_waiting_request_at_once() {
    let mut pair = Pair::new(Duration::from_secs(60));
    pair.register(key(3), 8, ids(0..2));
    pair.at(ms(50));
    pair.abort(TransferId(3), None);
    expect_failed(&pair, key(3), Reason::Aborted);
    assert_eq!(pair.decode_held(), 0);
}

/// Decode's engine cancels a registered request: it fails once prefill confirmed it writes
/// nothing more (at once here, not at the quiesce bound), and prefill gives the blocks of
/// its later finish back unsent.
#[test]
fn decodes_cancel_fails_once_prefill_confirms_and_prefill_gives_the_blocks_back() {
    let mut pair = Pair::new(Duration::from_secs(60));
    pair.register(key(4), 8, ids(0..2));
    pair.at(ms(50));
    pair.cancel(TransferId(4), None);
    let detail = expect_failed(&pair, key(4), Reason::Aborted);
    assert!(!detail.contains("without confirmation"), "{detail}");
    assert_eq!(pair.decode_stats().released_unconfirmed, 0);
    pair.at(ms(100));
    pair.finish(key(4), 8, ids(0..2));
    expect_given_back(&pair, key(4), SendOutcome::NotSent(Reason::Aborted));
    assert_eq!(pair.prefill_held(), 0);
}

/// Decode cancels while prefill's write is in flight: its engine hears of it only once
/// prefill says the write ended (it may land until then), however long that takes within
/// the quiesce bound; prefill holds the blocks until then too.
#[test]
fn a_cancel_under_a_write_in_flight_fails_only_once_the_write_ended() {
    let mut pair = Pair::configured(
        |_| {},
        |decode| {
            decode.registration_lease = Duration::from_secs(600);
            decode.quiesce_timeout = Some(Duration::from_secs(600));
        },
    );
    let k = key(101);
    pair.fill(&ids(5..8), 1);
    pair.register(k, 12, ids(0..3));
    pair.hold_transfers = true;
    pair.finish(k, 12, ids(5..8));
    assert_eq!(pair.prefill_held(), 1);
    pair.cancel(k.transfer, Some(k.attempt));
    pair.at(Duration::from_secs(300));
    assert_eq!(pair.events(), vec![], "failed with a write in flight");
    assert_eq!(pair.finished(), vec![]);
    assert_eq!(pair.prefill_held(), 1, "blocks released under a write");
    pair.hold_transfers = false;
    pair.at(Duration::from_secs(301));
    expect_failed(&pair, k, Reason::Aborted);
    assert!(matches!(
        &pair.finished()[..],
        [FinishedSending {
            outcome: SendOutcome::NotSent(_),
            ..
        }]
    ));
    assert_eq!((pair.prefill_held(), pair.decode_held()), (0, 0));
}

/// Decode cancels while prefill's write of a sealed request is in flight: it fails once
/// prefill says the write ended, as for a finished request; the engine's finish later gives
/// the blocks back.
#[test]
fn a_cancel_under_a_sealed_requests_write_fails_once_the_write_ended() {
    let mut pair = Pair::configured(
        |_| {},
        |decode| decode.quiesce_timeout = Some(Duration::from_secs(600)),
    );
    let k = key(103);
    pair.fill(&ids(5..7), 18);
    pair.register(k, 8, ids(0..2));
    pair.hold_transfers = true;
    pair.seal(k, 8, ids(5..7));
    pair.cancel(k.transfer, Some(k.attempt));
    pair.at(Duration::from_secs(1));
    assert_eq!(pair.events(), vec![], "failed with a write in flight");
    pair.hold_transfers = false;
    pair.at(Duration::from_secs(2));
    expect_failed(&pair, k, Reason::Aborted);
    assert_eq!(pair.decode_held(), 0);
    pair.finish(k, 8, ids(5..7));
    assert!(matches!(&pair.finished()[..], [FinishedSending { key: done, .. }] if *done == k));
    assert_eq!(pair.prefill_held(), 0);
}

/// Decode gives up on a request (its lease) in the very turn in which prefill's write of
/// it ends (finished or sealed, its notice lost): prefill, which heard the abort first,
/// tells decode that nothing runs any more once the write's end comes, and decode fails the
/// request then, not at its bound for prefill's word.
#[test]
fn an_abort_in_the_turn_a_write_ends_is_answered_once_the_write_ended() {
    for seal in [true, false] {
        let mut pair = Pair::configured(
            |_| {},
            |decode| {
                decode.quiesce_timeout = Some(Duration::from_secs(600));
                decode.registration_lease = Duration::from_secs(2);
            },
        );
        let k = key(104);
        pair.fill(&ids(5..7), 18);
        pair.register(k, 8, ids(0..2));
        pair.hold_transfers = true;
        if seal {
            pair.seal(k, 8, ids(5..7));
        } else {
            pair.finish(k, 8, ids(5..7));
        }
        pair.at(Duration::from_secs(1));
        // At the lease, the write's end (its notice lost) and decode's abort meet.
        pair.hold_transfers = false;
        pair.notices_to_lose = 1;
        pair.at(Duration::from_secs(2));
        assert_eq!(pair.notices_to_lose, 0);
        let detail = expect_failed(&pair, k, Reason::LeaseExpired);
        assert!(
            !detail.contains("without confirmation"),
            "seal {seal}: {detail}"
        );
        assert_eq!(pair.decode_stats().released_unconfirmed, 0);
        assert_eq!(pair.decode_held(), 0);
    }
}

/// Prefill's engine preempts an attempt: decode's wait for it fails at once, a finish for it
/// goes back unsent, and the request's next attempt is served.
#[test]
fn a_prefill_preempted_at_an_attempt_fails_it_and_serves_the_next() {
    let mut pair = Pair::new(Duration::from_secs(60));
    let first = key(102);
    pair.register(first, 8, ids(0..2));
    pair.at(ms(100));
    pair.preempt(first);
    expect_failed(&pair, first, Reason::Preempted);
    assert_eq!(pair.decode_held(), 0);
    pair.finish(first, 8, ids(2..4));
    assert!(matches!(
        &pair.finished()[..],
        [FinishedSending {
            outcome: SendOutcome::NotSent(_),
            ..
        }]
    ));
    let second = AttemptKey::new(first.transfer, first.attempt.next());
    pair.fill(&ids(0..2), 2);
    pair.register(second, 8, ids(4..6));
    pair.finish(second, 8, ids(0..2));
    expect_ready(&pair, second);
    assert!(pair.landed(&ids(0..2), &ids(4..6), 8));
    assert!(
        !pair.landed(&ids(0..2), &ids(0..2), 8),
        "the preempted attempt's blocks were written"
    );
    expect_given_back(&pair, second, SendOutcome::Sent);
    assert_eq!(pair.prefill_held(), 0);
}

/// Decode re-registers a request at a newer attempt (its engine preempted and rescheduled
/// it): the older wait fails as superseded, and prefill's finish of the newer lands.
#[test]
fn a_preempted_request_registers_again_at_a_newer_attempt_and_lands() {
    let mut pair = Pair::new(Duration::from_secs(60));
    let first = key(6);
    let second = AttemptKey::new(first.transfer, first.attempt.next());
    pair.fill(&ids(0..3), 3);
    pair.register(first, 12, ids(5..8));
    pair.at(ms(30));
    pair.register(second, 12, ids(8..11));
    expect_failed(&pair, first, Reason::Superseded);
    pair.finish(second, 12, ids(0..3));
    expect_ready(&pair, second);
    assert!(pair.landed(&ids(0..3), &ids(8..11), 12));
}

/// Prefill wrote and gave its blocks back, but the notice never reached decode: the
/// request fails at its lease (not later: prefill, holding nothing of it, answers decode's
/// abort at once), and nothing stays held on either side.
#[test]
fn a_lost_notice_fails_the_request_at_its_lease_and_nothing_stays_held() {
    let mut pair = Pair::new(ms(500));
    pair.notices_to_lose = 1;
    let k = key(97);
    pair.fill(&ids(0..2), 4);
    pair.register(k, 8, ids(4..6));
    pair.finish(k, 8, ids(0..2));
    expect_given_back(&pair, k, SendOutcome::Sent);
    assert_eq!(pair.notices_to_lose, 0, "the notice was not lost");
    pair.at(ms(499));
    assert_eq!(pair.events(), vec![]);
    pair.at(ms(500));
    let detail = expect_failed(&pair, k, Reason::LeaseExpired);
    assert!(!detail.contains("without confirmation"), "{detail}");
    assert_eq!(pair.decode_stats().released_unconfirmed, 0);
    assert_eq!((pair.prefill_held(), pair.decode_held()), (0, 0));
}

/// A sealed request written in full whose notice was lost: decode fails it at its lease, at
/// once (prefill, whose write ended, says so), not at its bound for prefill's word; the
/// engine's finish then gives the blocks back.
#[test]
fn a_sealed_requests_lost_notice_fails_it_at_its_lease_at_once() {
    let mut pair = Pair::configured(
        |_| {},
        |decode| {
            decode.registration_lease = ms(500);
            decode.quiesce_timeout = Some(Duration::from_secs(600));
        },
    );
    pair.cancel(TransferId(36), None);
    pair.notices_to_lose = 1;
    let k = key(36);
    pair.fill(&ids(0..2), 17);
    pair.seal(k, 8, ids(0..2));
    pair.register(k, 8, ids(4..6));
    assert_eq!(pair.notices_to_lose, 0, "the notice was not lost");
    pair.at(Duration::from_secs(600));
    let detail = expect_failed(&pair, k, Reason::LeaseExpired);
    assert!(!detail.contains("without confirmation"), "{detail}");
    assert_eq!(pair.decode_held(), 0);
    pair.finish(k, 8, ids(0..2));
    expect_given_back(&pair, k, SendOutcome::Sent);
    assert_eq!(pair.prefill_held(), 0);
}

/// A sealed request is written, and decode told, without waiting for the engine to finish
/// it (registration first or seal first); its blocks go back only once the engine has
/// finished it, at once then, and the finish writes nothing more.
#[test]
fn a_sealed_request_lands_before_it_finishes() {
    for registration_first in [true, false] {
        let mut pair = Pair::new(Duration::from_secs(60));
        let k = key(30);
        pair.fill(&ids(0..5), 5);
        if registration_first {
            pair.register(k, 19, ids(8..13));
            pair.seal(k, 19, ids(0..5));
        } else {
            pair.seal(k, 19, ids(0..5));
            pair.at(ms(20));
            pair.register(k, 19, ids(8..13));
        }
        expect_ready(&pair, k);
        assert!(pair.landed(&ids(0..5), &ids(8..13), 19));
        pair.at(Duration::from_secs(30));
        assert_eq!(pair.finished(), vec![], "given back before the finish");
        assert_eq!(pair.prefill_stats().transfers_ok, 1);
        pair.finish(k, 19, ids(0..5));
        expect_given_back(&pair, k, SendOutcome::Sent);
        assert_eq!(pair.prefill_held(), 0);
        assert_eq!(pair.prefill_stats().transfers_started, 1);
    }
}

/// A request finished after its seal but before decode registered is written when the
/// registration comes, and given back then.
#[test]
fn a_sealed_request_finished_before_its_registration_is_given_back_when_written() {
    let mut pair = Pair::new(Duration::from_secs(60));
    let k = key(31);
    pair.fill(&ids(0..3), 6);
    pair.seal(k, 12, ids(0..3));
    pair.finish(k, 12, ids(0..3));
    pair.at(Duration::from_secs(10));
    assert_eq!(pair.finished(), vec![]);
    pair.register(k, 12, ids(8..11));
    expect_ready(&pair, k);
    assert!(pair.landed(&ids(0..3), &ids(8..11), 12));
    expect_given_back(&pair, k, SendOutcome::Sent);
    assert_eq!(pair.prefill_stats().transfers_started, 1);
}

/// The engine aborts a sealed request (it frees the blocks itself): nothing is given back,
/// whether its transfer ended before or nobody registered yet, and a registration that
/// comes later fails.
#[test]
fn a_sealed_request_the_engine_aborts_is_never_given_back() {
    let mut pair = Pair::new(Duration::from_secs(60));
    let delivered = key(33);
    pair.fill(&ids(0..2), 7);
    pair.register(delivered, 8, ids(8..10));
    pair.seal(delivered, 8, ids(0..2));
    expect_ready(&pair, delivered);
    pair.abort(delivered.transfer, None);
    let late = key(34);
    pair.seal(late, 8, ids(2..4));
    pair.abort(late.transfer, None);
    pair.at(Duration::from_secs(30));
    assert_eq!(pair.finished(), vec![]);
    assert_eq!(pair.prefill_held(), 0);
    pair.register(late, 8, ids(12..14));
    expect_failed(&pair, late, Reason::Aborted);
    pair.at(Duration::from_secs(60));
    assert_eq!(pair.finished(), vec![]);
}

/// A seal after the request finished, or a second seal, changes nothing.
#[test]
fn a_second_seal_is_ignored() {
    let mut pair = Pair::new(Duration::from_secs(60));
    let k = key(35);
    pair.fill(&ids(0..2), 8);
    pair.seal(k, 8, ids(0..2));
    pair.seal(k, 8, ids(0..2));
    pair.finish(k, 8, ids(0..2));
    pair.seal(k, 8, ids(0..2));
    pair.register(k, 8, ids(8..10));
    expect_ready(&pair, k);
    assert!(pair.landed(&ids(0..2), &ids(8..10), 8));
    expect_given_back(&pair, k, SendOutcome::Sent);
    assert_eq!(pair.prefill_stats().transfers_started, 1);
    assert_eq!(pair.prefill_held(), 0);
}

/// Requests that all came over one connection and all ended are forgotten: prefill
/// remembers at most the 64 it keeps before it next forgets, not the whole history.
#[test]
fn a_long_lived_connection_forgets_the_registrations_that_ended() {
    let mut pair = Pair::new(Duration::from_secs(60));
    pair.fill(&ids(10..12), 9);
    for t in 0..200 {
        let k = key(1000 + t);
        pair.register(k, 8, ids(4..6));
        pair.finish(k, 8, ids(10..12));
        expect_ready(&pair, k);
        expect_given_back(&pair, k, SendOutcome::Sent);
    }
    assert!(pair.landed(&ids(10..12), &ids(4..6), 8));
    let remembered = pair.prefill_stats().remembered_registrations;
    assert!(remembered <= 64, "{remembered} registrations remembered");
}

/// The bytes of `tokens` tokens of every layer's K and V.
fn request_bytes(tokens: u64) -> u64 {
    let layout = Layout::new(spec()).expect("a valid layout");
    let token_bytes = layout.block_stride() / u64::from(layout.spec().block_tokens);
    tokens * token_bytes * u64::from(layout.kv_parts() * layout.spec().num_layers)
}

/// Layer-wise progress that goes back (fewer tokens in fewer layers: the engine computes
/// again) writes nothing more early, even once it is back where it was; the finish then
/// writes the whole request again, and decode gets every byte.
#[test]
fn layer_progress_going_back_is_rewritten_at_the_finish() {
    let mut pair = Pair::new(Duration::from_secs(60));
    pair.fill(&ids(0..4), 10);
    let k = key(14);
    pair.register(k, 16, ids(8..12));
    pair.progress(k, ids(0..4), 16, Some(1));
    // Whole blocks of both sides, never the last token.
    assert!(pair.landed_in(&ids(0..4), &ids(8..12), 0..12, 0..1));
    assert!(!pair.landed_in(&ids(0..4), &ids(8..12), 0..12, 1..2));
    let streamed = pair.prefill_stats().bytes_streamed;
    assert_eq!(streamed, request_bytes(12) / 2);
    pair.progress(k, ids(0..2), 8, Some(0));
    pair.progress(k, ids(0..4), 16, Some(1));
    pair.finish(k, 16, ids(0..4));
    expect_ready(&pair, k);
    assert!(pair.landed(&ids(0..4), &ids(8..12), 16));
    let stats = pair.prefill_stats();
    assert_eq!(
        stats.bytes_streamed, streamed,
        "no early write after going back"
    );
    assert_eq!(
        stats.bytes_written,
        streamed + request_bytes(16),
        "the finish rewrote everything"
    );
}

/// A preemption (progress without blocks) after layer-wise progress forgets what was
/// final: decode registering only afterwards gets the resumed request's KV from its new
/// blocks, written early as it computes again, and every byte is right.
#[test]
fn preemption_after_layer_progress_starts_over_for_a_later_registration() {
    let mut pair = Pair::new(Duration::from_secs(60));
    // The old blocks never hold the request's KV; the new ones do.
    pair.fill(&ids(0..4), 11);
    pair.fill(&ids(10..14), 12);
    let k = key(15);
    pair.progress(k, ids(0..4), 16, Some(1));
    pair.progress(k, Vec::new(), 0, None);
    pair.register(k, 16, ids(4..8));
    pair.at(ms(50));
    assert_eq!(
        pair.prefill_stats().bytes_streamed,
        0,
        "nothing is final after the preemption"
    );
    pair.progress(k, ids(10..14), 16, Some(1));
    assert!(pair.landed_in(&ids(10..14), &ids(4..8), 0..12, 0..1));
    pair.finish(k, 16, ids(10..14));
    expect_ready(&pair, k);
    assert!(pair.landed(&ids(10..14), &ids(4..8), 16));
    expect_given_back(&pair, k, SendOutcome::Sent);
}

/// An abort while early writes have landed fails decode's request; the later finish goes
/// back unsent.
#[test]
fn abort_after_early_writes_fails_the_consumer_and_releases_the_finish() {
    let mut pair = Pair::new(Duration::from_secs(60));
    let k = key(8);
    pair.fill(&ids(0..4), 13);
    pair.register(k, 16, ids(8..12));
    pair.at(ms(50));
    pair.progress(k, ids(0..3), 12, None);
    assert!(pair.landed(&ids(0..3), &ids(8..11), 12));
    pair.abort(k.transfer, None);
    expect_failed(&pair, k, Reason::Aborted);
    pair.finish(k, 16, ids(0..4));
    expect_given_back(&pair, k, SendOutcome::NotSent(Reason::Aborted));
    assert_eq!(pair.prefill_held(), 0);
}

/// Progress naming blocks outside prefill's cache fails decode's request at once (not at
/// the end of its lease), and the finish goes back unsent.
#[test]
fn bad_progress_fails_the_consumer_at_once() {
    let mut pair = Pair::new(Duration::from_secs(60));
    let k = key(6);
    pair.register(k, 16, ids(8..12));
    pair.at(ms(50));
    pair.progress(k, vec![BlockId(1), BlockId(9999)], 8, None);
    expect_failed(&pair, k, Reason::TransferFailed);
    pair.finish(k, 16, ids(0..4));
    assert!(matches!(
        &pair.finished()[..],
        [FinishedSending {
            outcome: SendOutcome::NotSent(_),
            ..
        }]
    ));
    assert_eq!(pair.prefill_held(), 0);
}

/// The engine computed a request again in other blocks (a preemption) after some of it was
/// written early from the old ones: the finish rewrites everything from the new blocks.
#[test]
fn changed_blocks_after_early_writes_are_rewritten_at_the_finish() {
    let mut pair = Pair::new(Duration::from_secs(60));
    // The old blocks hold stale bytes; the new ones the request's KV.
    pair.fill(&ids(0..4), 14);
    pair.fill(&ids(10..14), 15);
    let k = key(12);
    pair.register(k, 16, ids(4..8));
    pair.at(ms(50));
    pair.progress(k, ids(0..3), 12, None);
    assert!(pair.prefill_stats().bytes_streamed > 0, "no early write");
    pair.progress(k, ids(10..12), 8, None);
    pair.finish(k, 16, ids(10..14));
    expect_ready(&pair, k);
    assert!(pair.landed(&ids(10..14), &ids(4..8), 16));
    expect_given_back(&pair, k, SendOutcome::Sent);
}

/// A second wait for the same attempt is refused, and the refusal reaches neither prefill
/// nor the first wait, which lands.
#[test]
fn a_second_wait_for_the_same_attempt_is_refused_and_the_first_still_lands() {
    let mut pair = Pair::new(Duration::from_secs(60));
    let k = key(8);
    pair.fill(&ids(0..3), 16);
    pair.register_as(k, RequestId(1), 12, ids(4..7));
    pair.register_as(k, RequestId(2), 12, ids(8..11));
    assert!(
        matches!(
            &pair.events()[..],
            [RecvEvent::Failed {
                request: RequestId(2),
                reason: Reason::Duplicate,
                ..
            }]
        ),
        "the second wait was not refused"
    );
    pair.finish(k, 12, ids(0..3));
    assert_eq!(
        pair.events(),
        vec![RecvEvent::Ready {
            key: k,
            request: RequestId(1)
        }]
    );
    assert!(pair.landed(&ids(0..3), &ids(4..7), 12));
    assert!(!pair.landed(&ids(0..3), &ids(8..11), 12));
}
