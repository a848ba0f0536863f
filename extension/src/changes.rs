//! The change feed: which blocks entered and left this node's set since the caller last
//! asked, so that a steady cycle costs what changed instead of shared_buffers.
//!
//! `ccm_buffer_changes()` is called on both ends of the loop: on the primary its set is the
//! hot set (usage count above `ccm.usage_threshold`), on a standby (threshold -1) every
//! cached block. Shared memory keeps a *shadow* of what the feed last reported for each
//! buffer (20 bytes per buffer, 0.25% of shared_buffers). A call visits at most
//! `max_buffers` headers from a cursor that rotates through shared_buffers, compares each
//! with its shadow, and returns the blocks that left the set (`removed`: the buffer was
//! retagged or invalidated, or its usage count fell below the threshold) and those that
//! entered it (`added`). A block enters at a usage count above the threshold and stays
//! while its buffer holds it at the threshold or above, so that blocks at the threshold do
//! not flap in and out every cycle.
//!
//! With `colder` (a primary's feed for ccm-agent's fill_room), the feed also reports the
//! cached blocks below the hot set (usage count at or below the threshold) in two more
//! lists, `colder_added` and `colder_removed`, each with the usage count its sweep saw. A
//! block is in at most one of the two sets; one that warms or cools moves from one to the
//! other (it is listed in one set's removals and the other's additions). So the agent knows
//! what it could fill a standby's unused buffers with without a filter of the standby and a
//! scan of the primary: the same sweep serves both sets.
//!
//! A block can sit in the shadow of two buffers for a while (evicted from a buffer the
//! sweep has not reached yet and read into one it passed): it is then added twice and
//! removed once when the sweep reaches the old buffer. A subscriber that counts additions
//! and removals per block, as ccm-agent does, stays exact.
//!
//! One caller at a time owns the feed (its `subscriber` id) and acknowledges each answer
//! by passing its `seq` as `after` in the next call. Anything else (another subscriber, an
//! answer the caller did not get, another threshold, a call that failed in the middle, a
//! restarted server) resets the feed: the shadow is cleared and the following calls report
//! the whole set again as added. So a lost message costs a resend, never a block hidden for
//! good, and the node's real buffer headers stay the ground truth.
//!
//! `probe` answers, for blocks the caller sent to a standby, which ones this node holds *and
//! has already reported*: the buffer mapping table maps the block to a buffer whose shadow
//! holds it. A block confirmed this way cannot leave the buffer without a later sweep
//! reporting it, which a plain "is it cached" answer could not promise (a block loaded after
//! the sweep passed its buffer and evicted before the next would go unseen).
//!
//! Rules followed, as in bufmgr.c and pg_buffercache: headers are read without pinning
//! (buffers.rs, the optimistic read that ccm_hot_blocks() uses); the probe looks a tag up
//! the way PrefetchSharedBuffer() does (BufTableHashCode, the mapping partition's LWLock in
//! shared mode, BufTableLookup, release) and pins nothing. Nothing here changes a buffer.
//! The feed's own LWLock serializes callers. It is held for a slice of the sweep or the probe
//! at a time (`SLICE` headers or probed blocks) and released between slices, where the call
//! answers interrupts: LWLockAcquire holds them off, so a lock held for a whole pass would
//! make a cancel, statement_timeout, a recovery conflict or a termination wait for the end
//! of the pass. The pass is marked in shared memory with its backend's pid and local
//! transaction id, so that another caller waits for it (as it would have waited for the
//! lock) while that backend is still in that transaction, and sees a pass its caller left
//! by ERROR or FATAL as interrupted. Nobody else waits for the lock, and no other lock is
//! taken under the mapping partition lock. Every allocation is bounded by `max_buffers` or by
//! the probe's validated length (the probe is read in place) and made with `try_reserve`.

use ccm_codec::{encode_block_list, BlockAddress, BlockListView, HotBlock, MAX_FORK};
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PGRXSharedMemory, PgLwLock};

use crate::buffers;
use crate::call_shape;
use crate::compat;
use crate::errors;
use crate::failpoints;
use crate::gucs;
use crate::shmem::{self, ScanCounts};

/// The threshold of a standby's feed: every cached block is in the set.
const EVERY_CACHED_BLOCK: i32 = -1;

/// Headers visited (or blocks probed) under the lock at a time, between which the lock is
/// released, interrupts are answered and the progress is reported. 16384 headers take well
/// under a millisecond.
const SLICE: usize = 16384;

/// Which of the feed's sets a buffer's block was last reported in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Set {
    /// The hot set (a standby's feed: every cached block).
    Main,
    /// Cached below the hot set (feeds with `colder` only).
    Colder,
}

/// What the feed last reported for one buffer.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ShadowEntry {
    spc: u32,
    db: u32,
    rel: u32,
    block: u32,
    fork: u8,
    /// 0: nothing reported; 1: the block above is in the main set, 2: in the colder set
    /// (reported as added there, not yet as removed).
    in_set: u8,
    _pad: [u8; 2],
}

impl ShadowEntry {
    fn member(&self) -> Option<(BlockAddress, Set)> {
        let set = match self.in_set {
            1 => Set::Main,
            2 => Set::Colder,
            _ => return None,
        };
        Some((BlockAddress { spc: self.spc, db: self.db, rel: self.rel, fork: self.fork, block: self.block }, set))
    }

    fn set(&mut self, member: Option<(BlockAddress, Set)>) {
        *self = match member {
            None => ShadowEntry::default(),
            Some((a, set)) => ShadowEntry {
                spc: a.spc,
                db: a.db,
                rel: a.rel,
                block: a.block,
                fork: a.fork,
                in_set: if set == Set::Main { 1 } else { 2 },
                _pad: [0; 2],
            },
        };
    }
}

/// The feed's owner and position. Guarded by FEED's LWLock, as is the shadow.
#[derive(Clone, Copy, Debug, Default)]
pub struct FeedState {
    subscriber: i64,
    /// The seq of the last answer given (0: none since the server started or the reset).
    seq: i64,
    /// Last seq handed out; seqs are never reused within the server's life.
    last_seq: i64,
    threshold: i32,
    /// The colder set is reported too.
    colder: bool,
    /// Set while a call sweeps or probes: still set at the next call means that one is
    /// between two slices (`sweeper` is in the same transaction) or failed midway.
    in_sweep: bool,
    /// The backend and local transaction of the pass `in_sweep` marks.
    sweeper_pid: i32,
    sweeper_lxid: u32,
    cursor: u64,
    sweeps: u64,
    tracked: u64,
    /// Blocks added since the current sweep started (aurora_ccm_status()'s "sent").
    sweep_added: u64,
}

unsafe impl PGRXSharedMemory for FeedState {}

static FEED: PgLwLock<FeedState> = unsafe { PgLwLock::new(c"pg_ccm change feed") };

type FeedGuard = pgrx::lwlock::PgLwLockExclusiveGuard<'static, FeedState>;

/// Whether the pass `state` marks is still going on in another backend: that backend is
/// still in the transaction that started it. (This backend's own earlier pass, if any,
/// ended: a backend runs one call at a time.)
fn pass_in_progress(state: &FeedState) -> bool {
    if !state.in_sweep || state.sweeper_pid == unsafe { pg_sys::MyProcPid } {
        return false;
    }
    let proc_ = unsafe { pg_sys::BackendPidGetProc(state.sweeper_pid) };
    !proc_.is_null() && unsafe { compat::local_transaction_id(proc_) } == state.sweeper_lxid
}

/// Takes FEED's lock once no other backend's pass is between two of its slices.
fn lock_feed() -> FeedGuard {
    loop {
        let state = FEED.exclusive();
        if !pass_in_progress(&state) {
            return state;
        }
        drop(state);
        unsafe { pg_sys::pg_usleep(1000) };
        pg_sys::check_for_interrupts!();
    }
}

/// Marks the pass this call starts as this backend's.
fn start_pass(state: &mut FeedState) {
    state.in_sweep = true;
    state.sweeper_pid = unsafe { pg_sys::MyProcPid };
    state.sweeper_lxid = unsafe { compat::local_transaction_id(pg_sys::MyProc) };
}

/// Ends a slice: the lock is released, interrupts answered (an ERROR here leaves the pass
/// marked, and the next call starts the feed over), and the lock taken again. Another caller
/// that takes the lock meanwhile waits in lock_feed() for this pass.
fn pause(state: FeedGuard) -> FeedGuard {
    failpoints::feed_slice_delay();
    drop(state);
    pg_sys::check_for_interrupts!();
    FEED.exclusive()
}

/// The shadow array, NBuffers entries, set up by the shmem startup hook.
static mut SHADOW: *mut ShadowEntry = std::ptr::null_mut();
static mut PREV_SHMEM_REQUEST_HOOK: Option<unsafe extern "C-unwind" fn()> = None;
static mut PREV_SHMEM_STARTUP_HOOK: Option<unsafe extern "C-unwind" fn()> = None;

fn shadow_bytes() -> usize {
    buffers::buffer_count() * std::mem::size_of::<ShadowEntry>()
}

pub fn init() {
    pg_shmem_init!(FEED);
    unsafe {
        PREV_SHMEM_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(request_shadow);
        PREV_SHMEM_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(attach_shadow);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn request_shadow() {
    unsafe {
        if let Some(previous) = PREV_SHMEM_REQUEST_HOOK {
            previous();
        }
        pg_sys::RequestAddinShmemSpace(shadow_bytes());
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn attach_shadow() {
    unsafe {
        if let Some(previous) = PREV_SHMEM_STARTUP_HOOK {
            previous();
        }
        pg_sys::LWLockAcquire(compat::addin_shmem_init_lock(), pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let shadow = pg_sys::ShmemInitStruct(c"pg_ccm change feed shadow".as_ptr(), shadow_bytes(), &mut found);
        if !found {
            std::ptr::write_bytes(shadow.cast::<u8>(), 0, shadow_bytes());
        }
        SHADOW = shadow.cast();
        pg_sys::LWLockRelease(compat::addin_shmem_init_lock());
    }
}

/// The shadow array.
///
/// # Safety
/// The caller holds FEED's lock in exclusive mode, and marks the pass as its own, until it
/// drops the slice: only such holders touch the shadow.
unsafe fn shadow() -> &'static mut [ShadowEntry] {
    // SAFETY: SHADOW points at NBuffers entries in shared memory for the server's life.
    unsafe { std::slice::from_raw_parts_mut(SHADOW, buffers::buffer_count()) }
}

/// Why a call starts the feed over, if it does.
fn reset_reason(state: &FeedState, subscriber: i64, after: i64, threshold: i32, colder: bool) -> Option<&'static str> {
    if state.subscriber != subscriber {
        Some("new subscriber")
    } else if state.in_sweep {
        Some("interrupted")
    } else if state.threshold != threshold {
        Some("threshold changed")
    } else if state.colder != colder {
        Some("colder changed")
    } else if state.seq != after || after == 0 {
        Some("sequence mismatch")
    } else {
        None
    }
}

/// The set a buffer's block belongs to now, given what its shadow says: the main set from a
/// usage count above the threshold on, and while it stays at the threshold or above once
/// in; else, with `colder`, the colder set.
#[inline]
fn membership(
    now: Option<buffers::CachedBuffer>,
    before: Option<(BlockAddress, Set)>,
    threshold: i32,
    colder: bool,
) -> Option<(HotBlock, Set)> {
    let buffer = now?;
    if !buffer.permanent || buffer.address.fork > MAX_FORK {
        return None;
    }
    let usage = i32::from(buffer.usage);
    let stays = before == Some((buffer.address, Set::Main));
    let main = if stays { usage >= threshold } else { usage > threshold };
    let block = HotBlock { addr: buffer.address, usage: buffer.usage };
    if main {
        Some((block, Set::Main))
    } else if colder {
        Some((block, Set::Colder))
    } else {
        None
    }
}

fn push(list: &mut Vec<HotBlock>, block: HotBlock) {
    if list.len() == list.capacity() && list.try_reserve(list.len().max(1024)).is_err() {
        errors::out_of_memory("the changes of a sweep", (list.len() * 2 * std::mem::size_of::<HotBlock>()) as u64);
    }
    list.push(block);
}

/// What one sweep found.
#[derive(Default)]
struct Sweep {
    added: Vec<HotBlock>,
    removed: Vec<HotBlock>,
    colder_added: Vec<HotBlock>,
    colder_removed: Vec<HotBlock>,
    visited: u64,
}

/// Visits `budget` headers from the cursor on, updating the shadow, a slice at a time.
/// `report`: the hot set of the configured threshold, whose sweeps aurora_ccm_status()
/// counts as scans. The pass is marked as this call's (start_pass).
fn sweep(mut state: FeedGuard, budget: usize, report: bool) -> (FeedGuard, Sweep) {
    let threshold = state.threshold;
    let colder = state.colder;
    let count = buffers::buffer_count();
    let mut cursor = state.cursor as usize % count;
    let mut tracked = state.tracked;
    let mut sweep_added = state.sweep_added;
    let mut found = Sweep::default();
    for step in 0..budget.min(count) {
        if step % SLICE == 0 && step > 0 {
            if report {
                shmem::scan_progress(ScanCounts { sent: sweep_added, found: tracked }, cursor as u64);
            }
            state = pause(state);
        }
        // SAFETY: FEED is held exclusively, and the pass is ours.
        let shadow = unsafe { shadow() };
        let entry = &mut shadow[cursor];
        let before = entry.member();
        let now = membership(buffers::read_header(cursor), before, threshold, colder);
        let now_member = now.map(|(block, set)| (block.addr, set));
        if now_member != before {
            match before {
                Some((addr, Set::Main)) => {
                    push(&mut found.removed, HotBlock { addr, usage: 0 });
                    tracked -= 1;
                }
                Some((addr, Set::Colder)) => push(&mut found.colder_removed, HotBlock { addr, usage: 0 }),
                None => {}
            }
            match now {
                Some((block, Set::Main)) => {
                    push(&mut found.added, block);
                    tracked += 1;
                    sweep_added += 1;
                }
                Some((block, Set::Colder)) => push(&mut found.colder_added, block),
                None => {}
            }
            entry.set(now_member);
        }
        found.visited += 1;
        cursor += 1;
        if cursor == count {
            cursor = 0;
            state.sweeps += 1;
            if report {
                shmem::scan_finished(ScanCounts { sent: sweep_added, found: tracked }, count as u64);
                shmem::scan_started();
            }
            sweep_added = 0;
        }
    }
    state.cursor = cursor as u64;
    state.tracked = tracked;
    state.sweep_added = sweep_added;
    (state, found)
}

/// Whether this node holds `addr` in a buffer whose shadow reports it (see the header).
fn reported_and_held(shadow: &[ShadowEntry], addr: &BlockAddress) -> bool {
    let mut tag = compat::buffer_tag(addr);
    let buffer = unsafe {
        let hash = pg_sys::BufTableHashCode(&mut tag);
        let lock = compat::buffer_mapping_lock(hash);
        pg_sys::LWLockAcquire(lock, pg_sys::LWLockMode::LW_SHARED);
        let buffer = pg_sys::BufTableLookup(&mut tag, hash);
        pg_sys::LWLockRelease(lock);
        buffer
    };
    usize::try_from(buffer)
        .ok()
        .and_then(|index| shadow.get(index))
        .is_some_and(|entry| entry.member().is_some_and(|(held, _)| held == *addr))
}

/// The probe's blocks that this node holds as reported, a slice at a time.
fn probe_blocks(mut state: FeedGuard, probe: &BlockListView<'_>) -> (FeedGuard, Vec<HotBlock>) {
    let mut present = Vec::new();
    for (index, block) in probe.iter().enumerate() {
        if index % SLICE == 0 && index > 0 {
            state = pause(state);
        }
        // SAFETY: FEED is held exclusively, and the pass is ours.
        if reported_and_held(unsafe { shadow() }, &block.addr) {
            push(&mut present, block);
        }
    }
    (state, present)
}

fn resolve_threshold(usage_threshold: Option<i32>) -> (i32, bool) {
    let configured = gucs::USAGE_THRESHOLD.get();
    let threshold = usage_threshold.unwrap_or(configured);
    if threshold != EVERY_CACHED_BLOCK && !(0..=gucs::MAX_USAGE_THRESHOLD).contains(&threshold) {
        errors::invalid_argument(
            format!("invalid usage_threshold: {threshold}"),
            Some(format!(
                "The threshold ranges from 0 to {}, or is -1 for every cached block.",
                gucs::MAX_USAGE_THRESHOLD
            )),
        );
    }
    (threshold, threshold == configured)
}

fn encode(mut blocks: Vec<HotBlock>, tracked: u64, visited: u64) -> Vec<u8> {
    encode_block_list(&mut blocks, tracked, visited).unwrap_or_else(|error| errors::encode_failed(&error))
}

/// The blocks that entered and left this node's set since the caller's last answer.
///
/// SQL's `ccm_buffer_changes`, bound to the versioned symbol `ccm_buffer_changes_0_7_wrapper`
/// from catalog 0.7.0 on, as pg_stat_statements versions its symbols: a library older than
/// the catalog then fails the call with "could not find function" instead of forming a
/// tuple of the catalog's shape from fewer values. The catalogs of 0.5.0 and 0.6.0 bind
/// `ccm_buffer_changes_wrapper` (below), which checks their shape first.
#[allow(clippy::type_complexity)]
#[pg_extern(name = "ccm_buffer_changes", volatile, parallel_unsafe)]
fn ccm_buffer_changes_0_7(
    subscriber: i64,
    after: i64,
    usage_threshold: default!(Option<i32>, "NULL"),
    max_buffers: default!(Option<i64>, "NULL"),
    probe: default!(Option<&[u8]>, "NULL"),
    colder: default!(bool, false),
) -> TableIterator<
    'static,
    (
        name!(seq, i64),
        name!(reset, bool),
        name!(reset_reason, Option<String>),
        name!(buffers, i64),
        name!(tracked, i64),
        name!(sweeps, i64),
        name!(visited, i64),
        name!(added, Vec<u8>),
        name!(removed, Vec<u8>),
        name!(present, Option<Vec<u8>>),
        name!(colder_added, Option<Vec<u8>>),
        name!(colder_removed, Option<Vec<u8>>),
    ),
> {
    errors::require_enabled();
    if subscriber == 0 {
        errors::invalid_argument(
            "invalid subscriber: 0".into(),
            Some("A subscriber is a nonzero number its caller picks at random and keeps.".into()),
        );
    }
    let count = buffers::buffer_count();
    let budget = match max_buffers {
        None => count,
        Some(limit) if limit >= 0 => usize::try_from(limit).unwrap_or(usize::MAX).min(count),
        Some(limit) => errors::invalid_argument(
            format!("invalid max_buffers: {limit}"),
            Some("max_buffers must be zero or positive, or NULL for all of shared_buffers.".into()),
        ),
    };
    let (threshold, report) = resolve_threshold(usage_threshold);
    // Validated and bounded before the feed is touched: no list names more blocks than
    // this node has buffers.
    let probe = probe.map(|bytes| {
        BlockListView::parse_bounded(bytes, count as u64).unwrap_or_else(|error| {
            errors::block_list_refused(
                &error,
                &format!("ccm_buffer_changes() probes at most {count} blocks, the buffers of shared_buffers."),
            )
        })
    });

    let mut state = lock_feed();
    let reason = reset_reason(&state, subscriber, after, threshold, colder);
    if reason.is_some() {
        // SAFETY: FEED is held exclusively, and no other pass is in progress.
        unsafe { shadow() }.fill(ShadowEntry::default());
        *state = FeedState { last_seq: state.last_seq, subscriber, threshold, colder, ..FeedState::default() };
    }
    start_pass(&mut state);
    let (state, found) = sweep(state, budget, report);
    let (mut state, present) = match &probe {
        Some(list) => {
            let (state, present) = probe_blocks(state, list);
            (state, Some(present))
        }
        None => (state, None),
    };
    state.last_seq += 1;
    state.seq = state.last_seq;
    state.in_sweep = false;
    let snapshot = *state;
    drop(state);

    let visited = found.visited;
    let colder_lists = colder.then(|| {
        (
            encode(found.colder_added, snapshot.tracked, visited),
            encode(found.colder_removed, snapshot.tracked, visited),
        )
    });
    let (colder_added, colder_removed) = colder_lists.unzip();
    TableIterator::once((
        snapshot.seq,
        reason.is_some(),
        reason.map(str::to_string),
        count as i64,
        snapshot.tracked as i64,
        snapshot.sweeps as i64,
        visited as i64,
        encode(found.added, snapshot.tracked, visited),
        encode(found.removed, snapshot.tracked, visited),
        present.map(|blocks| encode(blocks, snapshot.tracked, visited)),
        colder_added,
        colder_removed,
    ))
}

/// The symbol the 0.5.0 and 0.6.0 catalogs bind `ccm_buffer_changes` to, for a node whose
/// library is updated before its catalog (the order README's "Upgrading" gives). The 0.6.0
/// catalog has this library's shape and is served; 0.5.0's (five arguments, ten columns) is
/// refused with a clear ERROR instead of being given twelve values for ten columns.
#[no_mangle]
#[pg_guard]
pub unsafe extern "C-unwind" fn ccm_buffer_changes_wrapper(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    call_shape::require(fcinfo, "ccm_buffer_changes", call_shape::Shape { arguments: 6, columns: 12 });
    unsafe { ccm_buffer_changes_0_7_wrapper(fcinfo) }
}

/// fmgr's "version 1 calling convention" record of the legacy symbol (PG_FUNCTION_INFO_V1).
#[no_mangle]
pub extern "C" fn pg_finfo_ccm_buffer_changes_wrapper() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}
