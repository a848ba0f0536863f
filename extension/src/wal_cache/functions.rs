//! Aurora's logical WAL cache functions and pg_ccm's status of the cache.
//!
//! `aurora_stat_logical_wal_cache()` lists every logical slot, counted or not: with the
//! cache off, or before the worker has seen a new slot, its counts are 0 and its hit rate
//! and reset time NULL.

use pgrx::prelude::*;

use super::shared::{self, CacheView};
use super::slots::{self, LogicalSlot};

/// A `pg_lsn` result (pgrx has no type for it; its Datum is the 64-bit position).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lsn(pub u64);

impl pgrx::IntoDatum for Lsn {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(pg_sys::Datum::from(self.0))
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::PG_LSNOID
    }
}

pgrx::impl_sql_translatable!(Lsn, "pg_lsn");

// SAFETY: a pg_lsn is a by-value 64-bit Datum; nothing is allocated.
unsafe impl pgrx::callconv::BoxRet for Lsn {
    unsafe fn box_into<'fcx>(
        self,
        fcinfo: &mut pgrx::callconv::FcInfo<'fcx>,
    ) -> pgrx::datum::Datum<'fcx> {
        unsafe { fcinfo.return_raw_datum(pg_sys::Datum::from(self.0)) }
    }
}

fn as_int8(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn timestamp(value: i64) -> Option<TimestampWithTimeZone> {
    TimestampWithTimeZone::try_from(value).ok()
}

#[pg_extern(volatile, parallel_safe)]
fn aurora_stat_logical_wal_cache() -> TableIterator<
    'static,
    (
        name!(name, String),
        name!(active_pid, Option<i32>),
        name!(cache_hit, i64),
        name!(cache_miss, i64),
        name!(blks_read, i64),
        name!(hit_rate, Option<String>),
        name!(last_reset_timestamp, Option<TimestampWithTimeZone>),
    ),
> {
    let rows: Vec<_> = slots::logical_slots()
        .into_iter()
        .map(|slot| {
            let entry = shared::counters(&slot);
            let (hits, misses) = entry.map_or((0, 0), |e| (e.counter.hits, e.counter.misses));
            (
                slot.name,
                (slot.active_pid != 0).then_some(slot.active_pid),
                as_int8(hits),
                as_int8(misses),
                as_int8(hits + misses),
                ccm_walcache::hit_rate_text(hits, hits + misses),
                entry.and_then(|e| timestamp(e.reset_at)),
            )
        })
        .collect();
    TableIterator::new(rows)
}

const RESET_DONE: &str = "Reset the logical wal cache counter.";
const SLOT_NOT_FOUND: &str = "Replication slot not found. Please try again.";

/// Resets one logical slot's counters, or every slot's when `slot_name` is NULL.
#[pg_extern(volatile, parallel_unsafe)]
fn aurora_stat_reset_wal_cache(slot_name: Option<&str>) -> &'static str {
    let all = slots::logical_slots();
    let chosen: Vec<&LogicalSlot> = match slot_name {
        None => all.iter().collect(),
        Some(name) => all.iter().filter(|slot| slot.name == name).collect(),
    };
    if slot_name.is_some() && chosen.is_empty() {
        return SLOT_NOT_FOUND;
    }
    for slot in chosen {
        shared::reset(slot);
    }
    RESET_DONE
}

/// The oldest WAL position whose page the cache holds; NULL when it is off or holds nothing.
#[pg_extern(volatile, parallel_safe)]
fn get_oldest_wal_cache_ptr() -> Option<Lsn> {
    let view = shared::view();
    (view.worker_pid != 0 && !view.held.is_empty()).then_some(Lsn(view.held.start))
}

fn mode(view: &CacheView) -> &'static str {
    if view.worker_pid == 0 {
        if super::cache_pages() == 0 {
            "off"
        } else {
            "starting"
        }
    } else if view.held.is_empty() {
        "empty"
    } else if view.locked == view.held {
        "locked"
    } else if view.locked.is_empty() {
        "mapped"
    } else {
        "partly locked"
    }
}

/// The cache as the worker last published it. `mode`: off (`ccm.logical_wal_cache` = 0),
/// starting (no worker yet), empty, locked (every held page locked in memory), partly locked
/// (the lock limit covers only the newest pages, or locking is under way), mapped (no page
/// locked). `size_blocks` is the size in use: the setting, at most a quarter of the server's
/// memory (the host's RAM, or its cgroup's memory limit if smaller).
#[pg_extern(volatile, parallel_safe)]
fn ccm_logical_wal_cache_status() -> TableIterator<
    'static,
    (
        name!(mode, &'static str),
        name!(size_blocks, i64),
        name!(worker_pid, Option<i32>),
        name!(oldest_ptr, Option<Lsn>),
        name!(newest_ptr, Option<Lsn>),
        name!(held_blocks, i64),
        name!(locked_blocks, i64),
        name!(lock_limit_bytes, Option<i64>),
    ),
> {
    let view = shared::view();
    let running = view.worker_pid != 0;
    let held = running && !view.held.is_empty();
    TableIterator::once((
        mode(&view),
        as_int8(super::cache_pages()),
        running.then_some(view.worker_pid),
        held.then_some(Lsn(view.held.start)),
        held.then_some(Lsn(view.held.end)),
        as_int8(if running { view.held.pages() } else { 0 }),
        as_int8(if running { view.locked.pages() } else { 0 }),
        (running && view.lock_limit != u64::MAX).then_some(as_int8(view.lock_limit)),
    ))
}
