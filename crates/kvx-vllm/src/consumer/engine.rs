//! The engine thread's entries into the consumer's state machine, the only places where a
//! thread other than the driver touches its state (under the same mutex, taken with `try_lock`
//! so that the engine never waits for the driver):
//!
//! - [`Machine::engine_register`]: a push request whose prefill ranks are all connected is
//!   registered at once, from the engine thread, instead of waking the driver for it;
//! - [`Machine::engine_read_transport`]: the transport's queue is read once where the driver is
//!   not reading it (libfabric `shm` needs its reads for peers' writes to land).
//!
//! Each carries out what the state machine asked for at once, as the driver does after an input
//! (a registration goes out from the engine thread, never blocking); a transport operation met
//! while the driver has the transport out for a wait is left to the driver.
//!
//! Each returns whether the parked driver must look again ([`Machine::needs_wake`]); the handle
//! then queues a `Command::Wake`. Everything else reaches the state machine as a command.

use super::*;

/// What became of a push request offered to [`Machine::engine_register`].
pub(super) enum EngineRegistration {
    /// Registered; `wake`: the driver must look again.
    Registered { wake: bool },
    /// Not here: it goes through the driver's queue (a prefill rank still to connect).
    ThroughQueue(Box<PushRequest>),
    /// The driver has ended.
    Closed,
}

impl Machine {
    /// Registers `request` on the engine thread when every writer rank of its prefill instance
    /// is connected. What the engine thread found ready in the board is left for the driver's
    /// next turn: taking it over here would queue actions, and so a wake-up.
    pub(super) fn engine_register(&mut self, request: PushRequest) -> EngineRegistration {
        if self.closed {
            return EngineRegistration::Closed;
        }
        if !self.registers_at_once(request.prefill) {
            return EngineRegistration::ThroughQueue(Box::new(request));
        }
        self.start(request, None);
        driver::Driven::carry_out(self);
        EngineRegistration::Registered {
            wake: self.needs_wake(),
        }
    }

    /// Reads the transport's queue once on the engine thread and handles what came; returns
    /// whether the driver must look again. Nothing when the driver has ended or holds the
    /// transport itself.
    pub(super) fn engine_read_transport(&mut self) -> bool {
        if self.closed {
            return false;
        }
        let mut events = Vec::new();
        if let Err(e) = self.io.poll(&mut events) {
            // The driver's next read meets it too, and handles it.
            debug!(error = %e, "transport poll failed on the engine thread");
            return false;
        }
        if events.is_empty() {
            return false;
        }
        for event in events {
            self.on_event(event);
        }
        driver::Driven::carry_out(self);
        self.needs_wake()
    }
}
