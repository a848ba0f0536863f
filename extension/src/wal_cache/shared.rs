//! The WAL cache's shared state: what the worker holds and each logical slot's counters.
//!
//! The worker publishes its windows and accounts for every slot once per tick; the SQL
//! functions read a copy. One LWLock suffices at a hundred short updates per second.
//! Counters are kept per slot-array index and carry the slot's name, so a slot dropped and
//! another created in its place starts from zero.

use ccm_walcache::{SlotCounter, Window};
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgLwLock};

use super::slots::LogicalSlot;

/// Slots beyond this index of the slot array are listed but not counted.
pub const MAX_TRACKED_SLOTS: usize = 256;
const NAME_BYTES: usize = pg_sys::NAMEDATALEN as usize;

#[derive(Clone, Copy, Debug)]
pub struct SlotEntry {
    pub tracked: bool,
    name: [u8; NAME_BYTES],
    pub counter: SlotCounter,
    /// When counting started or was last reset (TimestampTz).
    pub reset_at: i64,
}

impl Default for SlotEntry {
    fn default() -> Self {
        SlotEntry {
            tracked: false,
            name: [0; NAME_BYTES],
            counter: SlotCounter::default(),
            reset_at: 0,
        }
    }
}

impl SlotEntry {
    fn is_for(&self, name: &str) -> bool {
        self.tracked && self.name_str() == name
    }

    fn name_str(&self) -> &str {
        let len = self.name.iter().position(|&b| b == 0).unwrap_or(NAME_BYTES);
        std::str::from_utf8(&self.name[..len]).unwrap_or("")
    }

    fn start(name: &str, position: u64, now: i64) -> SlotEntry {
        let mut entry = SlotEntry {
            tracked: true,
            counter: SlotCounter::starting_at(position),
            reset_at: now,
            ..Default::default()
        };
        let bytes = name.as_bytes();
        let len = bytes.len().min(NAME_BYTES - 1);
        entry.name[..len].copy_from_slice(&bytes[..len]);
        entry
    }
}

/// What the worker holds, as last published.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheView {
    /// Process id of the worker; 0 when none runs.
    pub worker_pid: i32,
    /// The part of the newest `ccm.logical_wal_cache` pages behind the flush position
    /// that the cache holds: mapped, and locked or found resident.
    pub held: Window,
    /// The part of `held` locked in memory.
    pub locked: Window,
    /// RLIMIT_MEMLOCK in bytes (u64::MAX: unlimited).
    pub lock_limit: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct WalCacheShared {
    pub view: CacheView,
    pub slots: [SlotEntry; MAX_TRACKED_SLOTS],
}

impl Default for WalCacheShared {
    fn default() -> Self {
        WalCacheShared {
            view: CacheView::default(),
            slots: [SlotEntry::default(); MAX_TRACKED_SLOTS],
        }
    }
}

unsafe impl PGRXSharedMemory for WalCacheShared {}

static SHARED: PgLwLock<WalCacheShared> = unsafe { PgLwLock::new(c"pg_ccm logical wal cache") };

pub fn init() {
    pg_shmem_init!(SHARED);
}

pub fn publish(view: CacheView) {
    SHARED.exclusive().view = view;
}

pub fn view() -> CacheView {
    SHARED.share().view
}

/// Accounts for one tick: each slot's progress since the last, against the window the
/// cache held at the start of the tick (`held_before`). Slots seen for the first time
/// start counting at their current position; entries of vanished slots are cleared.
pub fn account(slots: &[LogicalSlot], held_before: Window) {
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let mut shared = SHARED.exclusive();
    let mut present = [false; MAX_TRACKED_SLOTS];
    // A slot being created has no position until decoding finds its consistent point.
    for slot in slots
        .iter()
        .filter(|s| s.index < MAX_TRACKED_SLOTS && s.position != 0)
    {
        present[slot.index] = true;
        let entry = &mut shared.slots[slot.index];
        if entry.is_for(&slot.name) {
            entry.counter.advance(slot.position, held_before);
        } else {
            *entry = SlotEntry::start(&slot.name, slot.position, now);
        }
    }
    for (entry, present) in shared.slots.iter_mut().zip(present) {
        if !present {
            entry.tracked = false;
        }
    }
}

/// The counters of a slot, if the worker is counting it.
pub fn counters(slot: &LogicalSlot) -> Option<SlotEntry> {
    let shared = SHARED.share();
    shared
        .slots
        .get(slot.index)
        .filter(|entry| entry.is_for(&slot.name))
        .copied()
}

/// Zeroes a slot's counters and stamps the reset time. A slot the worker has not counted
/// yet has nothing to reset; it starts from zero when first seen.
pub fn reset(slot: &LogicalSlot) {
    let now = unsafe { pg_sys::GetCurrentTimestamp() };
    let mut shared = SHARED.exclusive();
    if let Some(entry) = shared
        .slots
        .get_mut(slot.index)
        .filter(|entry| entry.is_for(&slot.name))
    {
        entry.counter.reset_counts();
        entry.reset_at = now;
    }
}
