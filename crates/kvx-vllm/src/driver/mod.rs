//! The driver thread both sides share: a side's state machine plugs into [`drive`], the one loop
//! that waits (on the command queue, the transport or the next deadline, never spinning),
//! hands the state machine what came and lets its time pass. Only the driver does I/O on the
//! side's behalf.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvx_rdma::transport::{Event, Transport};
use kvx_rendezvous::Timestamp;
use tracing::warn;

mod io;
mod mailbox;
mod queue;

pub(crate) use io::{Io, PostError, Posts, Refused, Sending};
pub(crate) use mailbox::Mailbox;
pub(crate) use queue::{command_queue, wait_commands, wait_turn, CommandReceiver, CommandSender};

/// Monotonic time since the side started, as the state machines want it; in the state-machine
/// tests, a virtual clock that moves only when the test moves it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock {
    start: Instant,
    /// The wall-clock time at `start`, from which a virtual clock's wall time counts.
    #[cfg(any(test, feature = "fuzzing"))]
    wall_start: std::time::SystemTime,
    /// Nanoseconds of a virtual clock, which replaces the real one.
    #[cfg(any(test, feature = "fuzzing"))]
    virtual_nanos: Option<&'static std::sync::atomic::AtomicU64>,
}

impl Clock {
    pub(crate) fn new() -> Self {
        Self {
            start: Instant::now(),
            #[cfg(any(test, feature = "fuzzing"))]
            wall_start: std::time::SystemTime::now(),
            #[cfg(any(test, feature = "fuzzing"))]
            virtual_nanos: None,
        }
    }

    /// A virtual clock reading `nanos` (which the test advances).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn virtual_at(nanos: &'static std::sync::atomic::AtomicU64) -> Self {
        Self {
            start: Instant::now(),
            wall_start: std::time::SystemTime::now(),
            virtual_nanos: Some(nanos),
        }
    }

    pub(crate) fn now(self) -> Timestamp {
        #[cfg(any(test, feature = "fuzzing"))]
        if let Some(nanos) = self.virtual_nanos {
            return Timestamp::from_nanos(nanos.load(std::sync::atomic::Ordering::SeqCst));
        }
        Timestamp::from_nanos(u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// The wall-clock time now: the real one, or (virtual) the start's plus the virtual time.
    pub(crate) fn wall(self) -> std::time::SystemTime {
        #[cfg(any(test, feature = "fuzzing"))]
        if self.virtual_nanos.is_some() {
            return self.wall_start + self.now().saturating_duration_since(Timestamp::ZERO);
        }
        std::time::SystemTime::now()
    }

    /// How long from now until `at` (zero if past).
    pub(crate) fn until(self, at: Timestamp) -> Duration {
        at.saturating_duration_since(self.now())
    }
}

/// How long a driver waits on a transport without a [`Waker`] when operations are in flight,
/// before it looks at its command queue again. The wait blocks on the transport's wait object
/// (a completion-queue wait), so such a driver with work in flight wakes at most this often;
/// without work in flight it blocks on its queue alone. A driver whose transport has a waker
/// blocks on the transport until an event, a command or its next deadline.
pub(crate) const TRANSPORT_SLICE: Duration = Duration::from_millis(1);

/// What a side's driver thread plugs into [`drive`]: its state machine, and how it waits.
///
/// The state machine takes its inputs through the `handle_*` methods and [`Driven::refused`],
/// and asks for its I/O (transport operations, control messages and closes, helper threads)
/// through its [`Posts`]; it does none itself. The
/// provided methods ([`Driven::command`], [`Driven::transport_event`], [`Driven::tick`]) are the
/// driver's side of each input: they hand it over, then carry out what it asked for and hand
/// back, as inputs, what the transport refused, before the next input.
///
/// The state sits behind a mutex that [`drive`] holds while it handles what came, and releases
/// while it waits, so that an engine thread may take an explicit fast path into the same state
/// meanwhile (the consumer's registration and notice-board reads; see `consumer`).
pub(crate) trait Driven {
    /// Commands from the engine and the connection threads.
    type Command;
    /// How long the loop, once stopping, waits for operations still in flight
    /// ([`Driven::draining`]) before it closes the transport.
    const DRAIN: Duration = Duration::ZERO;
    /// The side's clock.
    fn clock(&self) -> Clock;
    /// When the loop must look again at the latest, even with nothing to do.
    fn wake_at(&mut self) -> Option<Timestamp>;
    /// Whether the driver must read its transport while it waits (operations this side waits
    /// for are in flight, or notices are due there).
    fn busy(&self) -> bool;
    /// The loop is about to wait until `until`, on the transport or not (`busy`).
    fn parking(&mut self, _until: Option<Timestamp>, _busy: bool) {}
    /// The loop woke.
    fn woke(&mut self) {}
    /// The side's I/O, as the driver holds it.
    fn io(&mut self) -> &mut Io;
    /// What the state machine asked for and the driver has not carried out yet.
    fn posts(&mut self) -> &mut Posts;
    /// Whether `command` asks the driver to stop.
    fn is_shutdown(command: &Self::Command) -> bool;
    /// The state machine handles one command.
    fn handle_command(&mut self, command: Self::Command);
    /// The state machine handles one transport event (in its own names of operations and peers).
    fn handle_event(&mut self, event: Event);
    /// The state machine hears that the transport did not do what it asked.
    fn refused(&mut self, refused: Refused);
    /// The state machine lets time pass.
    fn handle_timeout(&mut self, now: Timestamp);
    /// The loop stops (a shutdown command, the engine's side of the queue gone, or the
    /// transport gone): the state machine's last decisions while the transport is open.
    /// `left`: the commands queued behind the shutdown.
    fn stopping(&mut self, left: Vec<Self::Command>);
    /// Once stopping: whether operations are in flight that the loop waits for (at most
    /// [`Driven::DRAIN`]) before it closes the transport.
    fn draining(&self) -> bool {
        false
    }
    /// The transport is closed: whatever still waited ends.
    fn stopped(&mut self) {}

    /// Hands the state machine `command`, then carries out what it asked for.
    fn command(&mut self, command: Self::Command) {
        self.handle_command(command);
        self.carry_out();
    }
    /// Hands the state machine what the transport reported (in the transport's names), then
    /// carries out what it asked for.
    fn transport_event(&mut self, event: Event) {
        if let Some(event) = self.io().translate(event) {
            self.handle_event(event);
        }
        self.carry_out();
    }
    /// Lets time pass in the state machine, then carries out what it asked for; last in the
    /// driver's turn, sends what waited for room in its control connections.
    fn tick(&mut self, now: Timestamp) {
        self.handle_timeout(now);
        self.carry_out();
        self.io().flush();
    }
    /// Carries out what the state machine asked for, in order, handing back what the transport
    /// refused (which may ask for more), until nothing is left or what is left waits for the
    /// transport, out for a wait (an engine thread's entry: the driver carries it out next).
    fn carry_out(&mut self) {
        loop {
            let posts = self.posts().take();
            if posts.is_empty() {
                return;
            }
            let mut refused = Vec::new();
            let left = self.io().carry_out(posts, &mut refused);
            let waits = !left.is_empty();
            self.posts().put_back(left);
            for r in refused {
                self.refused(r);
            }
            if waits {
                return;
            }
        }
    }
    /// The transport, to read after a wait on the command queue alone; `None`: gone.
    fn transport(&mut self) -> Option<&mut (dyn Transport + 'static)> {
        self.io().transport()
    }
}

/// The driver thread's loop, the one both sides run: wait for commands, transport events or
/// the next deadline (never spinning) with the state unlocked; handle what came with it locked;
/// let time pass; until a shutdown command, the engine's side of the queue or the transport is
/// gone.
pub(crate) fn drive<D: Driven>(state: &Mutex<D>, rx: &CommandReceiver<D::Command>) {
    let lock = || state.lock().unwrap_or_else(PoisonError::into_inner);
    let clock = lock().clock();
    let (mut events, mut commands) = (Vec::new(), Vec::new());
    loop {
        let (lent, deadline) = {
            let mut driver = lock();
            let deadline = driver.wake_at();
            let busy = driver.busy();
            driver.parking(deadline, busy);
            if driver.transport().is_none() {
                warn!("the driver's transport is gone");
                stop_driven(&mut *driver, clock, Vec::new());
                return;
            }
            // Waiting on the transport, the loop takes it along; otherwise it stays in the
            // state, where an engine thread's fast path can read it.
            let lent = if busy { driver.io().lend() } else { None };
            (lent, deadline)
        };
        let (turn, mut driver) = if let Some(mut transport) = lent {
            let turn = wait_turn(
                rx,
                transport.as_mut(),
                true,
                clock,
                deadline,
                &mut events,
                &mut commands,
            );
            let mut driver = lock();
            driver.io().give_back(transport);
            (turn, driver)
        } else {
            let open = wait_commands(rx, clock, deadline, &mut commands);
            let mut driver = lock();
            // Notices may arrive while nothing is in flight on this side.
            let turn = driver
                .transport()
                .map_or(Ok(open), |t| t.poll(&mut events).map(|_| open));
            (turn, driver)
        };
        driver.woke();
        let open = turn.unwrap_or_else(|e| {
            warn!(error = %e, "transport poll failed");
            true
        });
        let mut stop = !open;
        let mut left = Vec::new();
        for command in commands.drain(..) {
            if stop {
                left.push(command);
            } else if D::is_shutdown(&command) {
                stop = true;
            } else {
                driver.command(command);
            }
        }
        if stop {
            events.clear();
            // What the engine queued behind the shutdown goes to `stopping` too.
            left.extend(rx.take_queued());
            stop_driven(&mut *driver, clock, left);
            return;
        }
        for event in events.drain(..) {
            driver.transport_event(event);
        }
        driver.tick(clock.now());
    }
}

/// The end of a driver loop: the state machine's last decisions, the operations in flight
/// waited for (at most [`Driven::DRAIN`]), the transport closed, and then what still waited
/// ended.
fn stop_driven<D: Driven>(driver: &mut D, clock: Clock, left: Vec<D::Command>) {
    driver.stopping(left);
    driver.carry_out();
    let deadline = clock.now() + D::DRAIN;
    let mut events = Vec::new();
    while driver.draining() {
        let left = clock.until(deadline);
        let Some(transport) = driver.transport().filter(|_| !left.is_zero()) else {
            break;
        };
        if let Err(e) = transport.wait(&mut events, left) {
            warn!(error = %e, "transport wait failed while draining");
            break;
        }
        for event in events.drain(..) {
            driver.transport_event(event);
        }
    }
    driver.io().close();
    driver.stopped();
    // What it said last (its peers hear why their requests failed) and the connections it
    // closed; a transport operation is refused now.
    driver.carry_out();
}
