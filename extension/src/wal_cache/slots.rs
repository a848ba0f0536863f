//! Logical replication slots and how far each has decoded, read from shared memory.
//!
//! A slot's position is the furthest of its `confirmed_flush` and, while a walsender holds
//! it, that walsender's `sentPtr` (for a logical walsender, the end of the last record it
//! decoded). A backend decoding through `pg_logical_slot_get_changes()` publishes its
//! progress only through `confirmed_flush`, when the call ends.
//!
//! Fields are read under `ReplicationSlotControlLock` (shared), which keeps slots from being
//! created or dropped meanwhile, but without each slot's spinlock: the values are aligned
//! machine words, so a read sees an old or a new value, never a torn one, and an old one only
//! delays the accounting by one tick.
//!
//! Other processes write these structs while we read them, so no Rust reference to them (or
//! to the arrays holding them) is ever made: each field is read through a raw pointer
//! (`addr_of!`) with `read_volatile`.

use std::ptr::addr_of;

use pgrx::pg_sys;

use crate::compat;

/// One logical slot as the WAL cache sees it.
#[derive(Clone, Debug)]
pub struct LogicalSlot {
    /// Index in `ReplicationSlotCtl->replication_slots`.
    pub index: usize,
    pub name: String,
    /// The process holding the slot (a walsender or a backend), 0 when inactive.
    pub active_pid: i32,
    /// How far the slot has decoded (see the module comment).
    pub position: u64,
}

/// Holds `ReplicationSlotControlLock` in shared mode for its lifetime.
struct SlotControlShared(*mut pg_sys::LWLock);

impl SlotControlShared {
    fn acquire() -> Self {
        let lock = compat::replication_slot_control_lock();
        unsafe { pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_SHARED) };
        SlotControlShared(lock)
    }
}

impl Drop for SlotControlShared {
    fn drop(&mut self) {
        // An ERROR raised while held is cleaned up by LWLockReleaseAll() instead.
        unsafe { pg_sys::LWLockRelease(self.0) };
    }
}

/// Reads one field of shared memory that other processes may be writing.
///
/// # Safety
/// `field` must point to a live, aligned `T` in shared memory.
unsafe fn volatile<T: Copy>(field: *const T) -> T {
    unsafe { std::ptr::read_volatile(field) }
}

/// The `sentPtr` of each live walsender, by process id.
pub fn walsender_positions() -> Vec<(i32, u64)> {
    let mut positions = Vec::new();
    unsafe {
        let ctl = pg_sys::WalSndCtl;
        if ctl.is_null() {
            return positions;
        }
        let senders = addr_of!((*ctl).walsnds).cast::<pg_sys::WalSnd>();
        for i in 0..pg_sys::max_wal_senders.max(0) as usize {
            let sender = senders.add(i);
            let pid = volatile(addr_of!((*sender).pid));
            if pid == 0 {
                continue;
            }
            let sent = volatile(addr_of!((*sender).sentPtr));
            // A walsender that exited between the two reads and was replaced could pair its
            // successor's pid with its own position; the pid read again tells.
            if volatile(addr_of!((*sender).pid)) == pid {
                positions.push((pid, sent));
            }
        }
    }
    positions
}

/// A slot's name, copied byte by byte out of shared memory (NUL-terminated there).
unsafe fn slot_name(slot: *const pg_sys::ReplicationSlot) -> String {
    let name = unsafe { addr_of!((*slot).data.name.data) }.cast::<std::ffi::c_char>();
    let mut bytes = Vec::with_capacity(pg_sys::NAMEDATALEN as usize);
    for i in 0..pg_sys::NAMEDATALEN as usize - 1 {
        let byte = unsafe { volatile(name.add(i)) } as u8;
        if byte == 0 {
            break;
        }
        bytes.push(byte);
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Calls `each` with the index and address of every logical slot in use, holding
/// `ReplicationSlotControlLock` in shared mode meanwhile.
fn each_logical_slot(mut each: impl FnMut(usize, *const pg_sys::ReplicationSlot)) {
    let _lock = SlotControlShared::acquire();
    unsafe {
        let ctl = pg_sys::ReplicationSlotCtl;
        if ctl.is_null() {
            return;
        }
        let array = addr_of!((*ctl).replication_slots).cast::<pg_sys::ReplicationSlot>();
        for index in 0..pg_sys::max_replication_slots.max(0) as usize {
            let slot = array.add(index);
            if !volatile(addr_of!((*slot).in_use))
                || volatile(addr_of!((*slot).data.database)) == pg_sys::InvalidOid
            {
                continue; // free, or a physical slot
            }
            each(index, slot);
        }
    }
}

/// The oldest `restart_lsn` of the logical slots in use (0 when there is none): where
/// decoding through any of them starts reading WAL again.
pub fn logical_restart_minimum() -> u64 {
    let mut minimum = 0u64;
    each_logical_slot(|_, slot| {
        let restart = unsafe { volatile(addr_of!((*slot).data.restart_lsn)) };
        if restart != 0 && (minimum == 0 || restart < minimum) {
            minimum = restart;
        }
    });
    minimum
}

/// Every logical slot in use, oldest index first.
pub fn logical_slots() -> Vec<LogicalSlot> {
    let senders = walsender_positions();
    let mut slots = Vec::new();
    each_logical_slot(|index, slot| unsafe {
        let name = slot_name(slot);
        let active_pid = volatile(addr_of!((*slot).active_pid));
        let mut position = volatile(addr_of!((*slot).data.confirmed_flush));
        if active_pid != 0 {
            if let Some(&(_, sent)) = senders.iter().find(|(pid, _)| *pid == active_pid) {
                position = position.max(sent);
            }
        }
        slots.push(LogicalSlot {
            index,
            name,
            active_pid,
            position,
        });
    });
    slots
}
