//! Fault injection for test builds: widens race windows so that the integration tests can
//! catch races that are microseconds wide in production.
//!
//! Compiled only with the `failpoints` cargo feature (`scripts/install.sh --test-build`).
//! A release build has neither this code nor its GUCs, `ccm.test_prewarm_delay_ms`,
//! `ccm.test_feed_slice_delay_ms` and `ccm.test_wal_release_delay_ms`: `SET` of any of them
//! fails there as for any unknown parameter of a reserved prefix.

#[cfg(feature = "failpoints")]
mod enabled {
    use pgrx::{pg_sys, GucContext, GucFlags, GucRegistry, GucSetting};

    /// `ccm.test_prewarm_delay_ms`: how long ccm_prewarm() sleeps at each failpoint.
    pub static PREWARM_DELAY_MS: GucSetting<i32> = GucSetting::<i32>::new(0);

    /// `ccm.test_feed_slice_delay_ms`: how long each slice of a change-feed pass lasts more,
    /// under the feed's lock (where interrupts are held off).
    pub static FEED_SLICE_DELAY_MS: GucSetting<i32> = GucSetting::<i32>::new(0);

    /// `ccm.test_wal_release_delay_ms`: how long the WAL release worker sleeps before each
    /// walk of pg_wal (read at its start: the worker takes no reload).
    pub static WAL_RELEASE_DELAY_MS: GucSetting<i32> = GucSetting::<i32>::new(0);

    pub fn init() {
        GucRegistry::define_int_guc(
            c"ccm.test_prewarm_delay_ms",
            c"Test builds only: ccm_prewarm() sleeps this long at each failpoint.",
            c"Widens the window between reading blocks and the checks that follow, for race tests.",
            &PREWARM_DELAY_MS,
            0,
            60_000,
            GucContext::Suset,
            GucFlags::UNIT_MS,
        );
        GucRegistry::define_int_guc(
            c"ccm.test_feed_slice_delay_ms",
            c"Test builds only: each slice of a ccm_buffer_changes() pass lasts this much longer.",
            c"Sleeps under the change feed's lock at the end of each slice, as a slice over a huge buffer pool would take.",
            &FEED_SLICE_DELAY_MS,
            0,
            60_000,
            GucContext::Suset,
            GucFlags::UNIT_MS,
        );
        GucRegistry::define_int_guc(
            c"ccm.test_wal_release_delay_ms",
            c"Test builds only: the WAL release worker sleeps this long before each walk of pg_wal.",
            c"So that a shutdown request arrives just before the walk, whose every file asks whether to stop.",
            &WAL_RELEASE_DELAY_MS,
            0,
            60_000,
            GucContext::Sighup,
            GucFlags::UNIT_MS,
        );
    }

    /// Sleeps `ccm.test_wal_release_delay_ms`, saying so in the server log first (the tests
    /// wait for that line); a signal ends the sleep early, and the walk that follows must see
    /// it.
    pub fn wal_release_delay() {
        let delay = WAL_RELEASE_DELAY_MS.get();
        if delay > 0 {
            pgrx::warning!("pg_ccm failpoint: the WAL release worker sleeps {delay} ms before its walk of pg_wal");
            unsafe { pg_sys::pg_usleep(i64::from(delay) * 1000) };
        }
    }

    /// Sleeps `ccm.test_feed_slice_delay_ms` without answering interrupts (the caller holds
    /// an LWLock, which holds them off anyway).
    pub fn feed_slice_delay() {
        let delay = FEED_SLICE_DELAY_MS.get();
        if delay > 0 {
            unsafe { pg_sys::pg_usleep(i64::from(delay) * 1000) };
        }
    }

    /// Sleeps `ccm.test_prewarm_delay_ms`, answering interrupts every 10 ms.
    pub fn prewarm_delay() {
        let mut left = PREWARM_DELAY_MS.get();
        while left > 0 {
            let step = left.min(10);
            unsafe { pg_sys::pg_usleep(i64::from(step) * 1000) };
            pg_sys::check_for_interrupts!();
            left -= step;
        }
    }
}

#[cfg(feature = "failpoints")]
pub use enabled::{feed_slice_delay, init, prewarm_delay, wal_release_delay};

#[cfg(not(feature = "failpoints"))]
pub fn init() {}

/// A failpoint: does nothing in a release build.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn prewarm_delay() {}

/// A failpoint: does nothing in a release build.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn feed_slice_delay() {}

/// A failpoint: does nothing in a release build.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn wal_release_delay() {}
