//! Reading buffer headers: what shared_buffers holds, and how hot each page is.
//!
//! pg_buffercache takes every buffer header's spinlock. A CCM scan runs every second
//! over all of shared_buffers, so it reads headers optimistically instead, the way a
//! seqlock reader does: load the state word, copy the tag twice, load the state again,
//! and accept the copy if the header was unlocked both times, its tag-related flags did
//! not change and both copies agree. A tag changes only under the header lock and never
//! without clearing BM_VALID until the new page is read, so a copy torn by a concurrent
//! retag is rejected, and an accepted copy is a tag the buffer held during the read. It
//! is not a proof: a reader preempted between its loads while the buffer is retagged
//! twice (A to B to A') could accept a tag the buffer no longer holds. Only headers that
//! are locked at that moment are read under the lock. The result is a hint either way: a
//! stale tag costs at most a block sent once more or held back for one cycle (the next
//! filter has another seed), and the standby reads every page from its own files.

use std::sync::atomic::{fence, AtomicU32, Ordering};

use ccm_codec::BlockAddress;
use pgrx::pg_sys;

use crate::compat;

/// What one valid buffer holds.
#[derive(Clone, Copy, Debug)]
pub struct CachedBuffer {
    pub address: BlockAddress,
    /// Clock-sweep usage count, 0..=BM_MAX_USAGE_COUNT.
    pub usage: u8,
    /// BM_PERMANENT: a WAL-logged relation. Unlogged and temporary pages are not set,
    /// and a standby does not have them.
    pub permanent: bool,
}

const TAG_FLAGS: u32 = pg_sys::BM_LOCKED | pg_sys::BM_VALID | pg_sys::BM_TAG_VALID;
const VALID: u32 = pg_sys::BM_VALID | pg_sys::BM_TAG_VALID;

/// Number of buffers in shared_buffers.
pub fn buffer_count() -> usize {
    unsafe { pg_sys::NBuffers as usize }
}

fn state_word(desc: *mut pg_sys::BufferDesc) -> &'static AtomicU32 {
    // SAFETY: pg_atomic_uint32 is a u32 in shared memory that PostgreSQL only touches
    // atomically; the descriptor array lives as long as the server.
    unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*desc).state.value)) }
}

fn usage_count(state: u32) -> u8 {
    ((state & pg_sys::BUF_USAGECOUNT_MASK) >> pg_sys::BUF_USAGECOUNT_SHIFT) as u8
}

fn cached_buffer(tag: &pg_sys::BufferTag, state: u32) -> CachedBuffer {
    CachedBuffer {
        address: compat::tag_address(tag),
        usage: usage_count(state),
        permanent: state & pg_sys::BM_PERMANENT != 0,
    }
}

/// Reads buffer `index` (0-based). `None` when it holds no valid page.
#[inline]
pub fn read_header(index: usize) -> Option<CachedBuffer> {
    let desc = unsafe { compat::buffer_descriptor(index) };
    let state = state_word(desc);
    let before = state.load(Ordering::Acquire);
    if before & pg_sys::BM_LOCKED != 0 {
        return read_header_locked(desc);
    }
    if before & VALID != VALID {
        return None;
    }
    let tag = unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*desc).tag)) };
    let again = unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*desc).tag)) };
    // Keep the tag loads before the second state load.
    fence(Ordering::Acquire);
    let after = state.load(Ordering::Relaxed);
    if after & TAG_FLAGS != before & TAG_FLAGS || !same_tag(&tag, &again) {
        return read_header_locked(desc);
    }
    Some(cached_buffer(&tag, after))
}

fn same_tag(a: &pg_sys::BufferTag, b: &pg_sys::BufferTag) -> bool {
    compat::tag_address(a) == compat::tag_address(b)
}

#[cold]
fn read_header_locked(desc: *mut pg_sys::BufferDesc) -> Option<CachedBuffer> {
    let state = unsafe { pg_sys::LockBufHdr(desc) };
    let tag = unsafe { std::ptr::read(std::ptr::addr_of!((*desc).tag)) };
    // UnlockBufHdr(): only the lock holder may write the state word.
    state_word(desc).store(state & !pg_sys::BM_LOCKED, Ordering::Release);
    (state & VALID == VALID).then(|| cached_buffer(&tag, state))
}

/// Raises the usage count of a pinned buffer to at least `target` (capped at
/// BM_MAX_USAGE_COUNT), so that a prewarmed page survives the clock sweep as long as
/// the primary's copy would. Same compare-and-swap protocol as PinBuffer(); a header
/// that is locked meanwhile is updated under LockBufHdr(), whose spin-delay backoff and
/// stuck-spinlock detection are PostgreSQL's own, instead of spinning here.
pub fn raise_usage_count(buffer: pg_sys::Buffer, target: u8) {
    let target = u32::from(target).min(pg_sys::BM_MAX_USAGE_COUNT);
    debug_assert!(buffer > 0, "local or invalid buffer");
    let desc = unsafe { compat::buffer_descriptor(buffer as usize - 1) };
    let state = state_word(desc);
    let mut current = state.load(Ordering::Relaxed);
    while current & pg_sys::BM_LOCKED == 0 {
        if u32::from(usage_count(current)) >= target {
            return;
        }
        match state.compare_exchange_weak(current, with_usage(current, target), Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return,
            Err(actual) => current = actual,
        }
    }
    let locked = unsafe { pg_sys::LockBufHdr(desc) };
    let raised = if u32::from(usage_count(locked)) >= target { locked } else { with_usage(locked, target) };
    // UnlockBufHdr(): only the lock holder may write the state word.
    state.store(raised & !pg_sys::BM_LOCKED, Ordering::Release);
}

fn with_usage(state: u32, usage: u32) -> u32 {
    (state & !pg_sys::BUF_USAGECOUNT_MASK) | (usage << pg_sys::BUF_USAGECOUNT_SHIFT)
}
