//! What pg_ccm's background workers share: knowing that they must stop.
//!
//! pgrx's SIGTERM handler (`attach_signal_handlers`) sets a flag of its own, PostgreSQL's
//! `ShutdownRequestPending` and the latch. `BackgroundWorker::sigterm_received()` consumes
//! pgrx's flag (a swap), and `wait_latch` reads it through that same call: a worker that asks
//! `sigterm_received()` inside its work and then waits on its latch has taken the request
//! away from its main loop, which runs on, and a fast shutdown waits for that worker forever
//! (the WAL release worker did so, asking between the files of its walk of pg_wal).
//! `ShutdownRequestPending` is set by the handler and never reset, as for the checkpointer
//! and the walwriter (`HandleMainLoopInterrupts` in interrupt.c), so it is what a worker asks
//! in the middle of its work; the main loop's `wait_latch` still sees pgrx's flag.

use pgrx::pg_sys;

/// Whether the worker should stop what it is doing and leave: SIGTERM, or the postmaster
/// died. Consumes nothing, so it may be asked any number of times.
pub fn stop_requested() -> bool {
    pg_sys::check_for_interrupts!();
    unsafe {
        if std::ptr::read_volatile(&raw const pg_sys::ShutdownRequestPending) != 0 {
            return true;
        }
        // Without WL_LATCH_SET and with a zero timeout this only polls for postmaster death.
        let events = pg_sys::WaitLatch(
            std::ptr::null_mut(),
            (pg_sys::WL_TIMEOUT | pg_sys::WL_POSTMASTER_DEATH) as i32,
            0,
            pg_sys::PG_WAIT_EXTENSION,
        );
        events & pg_sys::WL_POSTMASTER_DEATH as i32 != 0
    }
}
