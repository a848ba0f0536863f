//! Reading buffer headers: what shared_buffers holds, and how hot each page is.
//!
//! pg_buffercache takes every buffer header's spinlock. A CCM scan runs every second
//! over all of shared_buffers, so it reads headers optimistically instead, the way a
//! seqlock reader does: load the state word, copy the tag, load the state again, and
//! accept the copy if the header was unlocked both times and its tag-related flags did
//! not change. A tag can only change under the header lock and never without clearing
//! BM_VALID until the new page is read, so an accepted copy is a tag the buffer really
//! held. Only headers that are locked at that moment are read under the lock. The result
//! is a hint either way: the standby reads the page from its own files.

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
    // Keep the tag loads before the second state load.
    fence(Ordering::Acquire);
    let after = state.load(Ordering::Relaxed);
    if after & TAG_FLAGS != before & TAG_FLAGS {
        return read_header_locked(desc);
    }
    Some(cached_buffer(&tag, after))
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
/// the primary's copy would. Same compare-and-swap protocol as PinBuffer().
pub fn raise_usage_count(buffer: pg_sys::Buffer, target: u8) {
    let target = u32::from(target).min(pg_sys::BM_MAX_USAGE_COUNT);
    debug_assert!(buffer > 0, "local or invalid buffer");
    let desc = unsafe { compat::buffer_descriptor(buffer as usize - 1) };
    let state = state_word(desc);
    let mut current = state.load(Ordering::Relaxed);
    loop {
        if current & pg_sys::BM_LOCKED != 0 {
            std::hint::spin_loop();
            current = state.load(Ordering::Relaxed);
            continue;
        }
        if u32::from(usage_count(current)) >= target {
            return;
        }
        let wanted = (current & !pg_sys::BUF_USAGECOUNT_MASK)
            | (target << pg_sys::BUF_USAGECOUNT_SHIFT);
        match state.compare_exchange_weak(current, wanted, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return,
            Err(actual) => current = actual,
        }
    }
}
