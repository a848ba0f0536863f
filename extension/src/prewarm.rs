//! The standby's side of the loop: read the listed blocks into shared_buffers.
//!
//! Blocks are read in the list's order, which is file order (ccm_hot_blocks() and the agent
//! list blocks by address), as pg_prewarm and autoprewarm read them (autoprewarm sorts its
//! blocks by database, tablespace, relfilenode, fork and block before loading). Each loaded
//! buffer gets a usage count at least the primary's (capped at BM_MAX_USAGE_COUNT), so that
//! the clock sweep evicts colder pages before these, here and after promotion. Which blocks
//! come first across calls is the caller's choice: the agent sends the hottest first when
//! the standby lacks room for all of them, so that a cycle cut short has loaded those.
//! Within one call, hottest first would read a stretch of a file in scattered pieces:
//! measured on a cold standby, about a third more CPU and time than the same blocks in file
//! order (BENCHMARKS.md, "Cold restart: the read order"). A scattered list is read with
//! many reads in flight:
//! readahead threads (readahead.rs) advise the kernel of upcoming blocks ahead of the
//! backend's reads, across locked runs; on PostgreSQL 17 and later the backend also reads
//! each run through a read stream (compat::stream_reads; asynchronous I/O on 18), which
//! drains at the end of every run. Together they measured faster than either alone.
//!
//! How it respects replay: exactly as pg_prewarm and autoprewarm do. Each block is read
//! through its relation (ReadBufferExtended) while this backend holds AccessShareLock on
//! that relation. Replay changes a relation's files only under the AccessExclusiveLock
//! the primary logged for truncation, DROP, TRUNCATE and rewrites (VACUUM FULL, CLUSTER,
//! REINDEX, SET TABLESPACE), so a reader holding the weaker lock and replay's change never
//! overlap: the fork's size read under the lock stays true until it is released, and no
//! read can land between replay's buffer drop and its ftruncate. Two exceptions, both kept
//! out: ALTER SEQUENCE gives a sequence new storage under a weaker lock (sequences are
//! skipped: one block each), and database-wide changes (DROP DATABASE, ALTER DATABASE SET
//! TABLESPACE) are guarded by replay terminating every session of that database instead.
//! The lock is taken conditionally: if replay holds or awaits it, the relation is skipped
//! for this call, never waited for. Replay waits for us at most one run of reads
//! (`READS_PER_LOCK` blocks or `LOCK_HOLD`, whichever ends first) plus the catalog lookups
//! of opening the relation, and the lock is released between runs; past
//! max_standby_streaming_delay it cancels the statement, an ordinary recovery conflict.
//! Nothing here discards a buffer: a loaded page is an ordinary clean page, as after a
//! SELECT.
//!
//! Relation OIDs only mean something inside one database, so the calling backend reads the
//! blocks of the database it is connected to and of the shared catalogs, and hands the
//! blocks of each other database to a short-lived background worker connected to that
//! database (prewarm_worker.rs), as autoprewarm starts one worker per database. Blocks of
//! relations that are gone or rewritten, past the end of their file, unlogged (a standby
//! has only their init fork), locked by replay, or in a database that does not exist or
//! takes no connections are skipped and counted, never an error.
//! A block that cannot be read (I/O error, checksum failure) raises the ERROR
//! ReadBufferExtended raises, as pg_prewarm does.
//!
//! No subtransactions: PostgreSQL turns a recovery conflict inside a subtransaction into
//! FATAL (postgres.c, RecoveryConflictInterrupt), so the whole call runs in the caller's
//! transaction, and a conflict cancels the statement.

use std::time::{Duration, Instant};

use ccm_codec::{BlockList, RelFork};
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;

use crate::buffers;
use crate::compat;
use crate::errors;
use crate::failpoints;
use crate::gucs;
use crate::prewarm_worker;
use crate::readahead::{Progress, ReadaheadPlan};

/// Most reads under one lock: replay waits at most this long for a truncation or DROP.
/// On storage slower than about 10 µs per read LOCK_HOLD ends a run first; 1024 rather
/// than 256 lets a read stream (17+) run four times longer before it drains
/// (BENCHMARKS.md: a whole relation on 18).
const READS_PER_LOCK: usize = 1024;
/// Longest a run holds its lock before letting replay in (checked between reads).
const LOCK_HOLD: Duration = Duration::from_millis(10);

const INIT_FORK: u8 = pg_sys::ForkNumber::INIT_FORKNUM as u8;
const ACCESS_SHARE: pg_sys::LOCKMODE = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
const NO_LOCK: pg_sys::LOCKMODE = pg_sys::NoLock as pg_sys::LOCKMODE;

/// What happened to the requested blocks; every block is counted exactly once. Plain
/// integers only: a worker hands it back through shared memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Outcome {
    pub loaded: u64,
    pub already_cached: u64,
    pub skipped_relation_gone: u64,
    pub skipped_past_end: u64,
    pub skipped_unlogged: u64,
    pub skipped_sequence: u64,
    pub skipped_locked: u64,
    /// In a database that takes no connections (template0), or no worker could start.
    pub skipped_other_database: u64,
    pub skipped_unknown_database: u64,
}

impl Outcome {
    pub fn add(&mut self, other: &Outcome) {
        self.loaded += other.loaded;
        self.already_cached += other.already_cached;
        self.skipped_relation_gone += other.skipped_relation_gone;
        self.skipped_past_end += other.skipped_past_end;
        self.skipped_unlogged += other.skipped_unlogged;
        self.skipped_sequence += other.skipped_sequence;
        self.skipped_locked += other.skipped_locked;
        self.skipped_other_database += other.skipped_other_database;
        self.skipped_unknown_database += other.skipped_unknown_database;
    }

    fn skipped(&self) -> u64 {
        self.skipped_relation_gone
            + self.skipped_past_end
            + self.skipped_unlogged
            + self.skipped_sequence
            + self.skipped_locked
            + self.skipped_other_database
            + self.skipped_unknown_database
    }

    pub fn skip(&mut self, reason: ForkSkip, blocks: u64) {
        let counter = match reason {
            ForkSkip::RelationGone => &mut self.skipped_relation_gone,
            ForkSkip::Unlogged => &mut self.skipped_unlogged,
            ForkSkip::Sequence => &mut self.skipped_sequence,
            ForkSkip::LockedByReplay => &mut self.skipped_locked,
            ForkSkip::OtherDatabase => &mut self.skipped_other_database,
        };
        *counter += blocks;
    }
}

/// Why a whole fork is skipped (for the rest of this call).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ForkSkip {
    RelationGone,
    Unlogged,
    /// ALTER SEQUENCE replaces a sequence's storage without an AccessExclusiveLock.
    Sequence,
    LockedByReplay,
    /// Read by another process (the caller or a worker), or not at all.
    OtherDatabase,
}

/// A fork of the list, as found on this node.
struct ForkState {
    rel: RelFork,
    /// The relation's OID, once looked up.
    relid: Option<pg_sys::Oid>,
    skip: Option<ForkSkip>,
    /// The fork was found on disk under a lock. A fork of an unchanged relation is never
    /// removed, so later runs need not ask again (mdexists closes every open segment).
    exists: bool,
}

/// One block to read.
#[derive(Clone, Copy)]
struct Read {
    fork: u32,
    block: u32,
    usage: u8,
}

/// Raises the ERROR for a node that is not (or no longer) a standby.
pub(crate) fn require_recovery() {
    require_recovery_for("ccm_prewarm() loads blocks only on a standby.");
}

/// Raises the ERROR for a node that is not (or no longer) a standby, `detail` saying which
/// function needs one.
pub(crate) fn require_recovery_for(detail: &str) {
    if !unsafe { pg_sys::RecoveryInProgress() } {
        errors::raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "recovery is not in progress".into(),
            Some(detail.into()),
            Some("Run it on a hot standby; if this node was just promoted, warm the new standby instead."),
        );
    }
}

/// The reads of the forks this process reads, in the list's (file) order.
fn plan_reads(list: &BlockList, forks: &[ForkState]) -> Vec<Read> {
    let mut reads: Vec<Read> = Vec::new();
    if reads.try_reserve_exact(list.len()).is_err() {
        errors::out_of_memory("the reads of a block list", (list.len() * std::mem::size_of::<Read>()) as u64);
    }
    for (index, (group, fork)) in list.groups.iter().zip(forks).enumerate() {
        if fork.skip.is_some() {
            continue;
        }
        for (&block, &usage) in group.blocks.iter().zip(&group.usage) {
            reads.push(Read { fork: index as u32, block, usage });
        }
    }
    reads
}

/// A relation this backend holds AccessShareLock on, with the fork's size read under it.
struct LockedFork {
    relid: pg_sys::Oid,
    relation: pg_sys::Relation,
    nblocks: u32,
    /// When the lock was granted: a run gives it back after `LOCK_HOLD`.
    since: Instant,
}

impl LockedFork {
    /// Locks the fork's relation without waiting, as long as it still has the storage the
    /// list names; otherwise records why the fork is skipped and returns `None`.
    fn acquire(fork: &mut ForkState) -> Option<LockedFork> {
        // Relations without storage of their own have relfilenode 0 in pg_class.
        let known = fork.rel.rel != 0;
        let relid = match fork.relid.or_else(|| known.then(|| compat::relation_oid(fork.rel)).flatten()) {
            Some(relid) => relid,
            None => {
                fork.skip = Some(ForkSkip::RelationGone);
                return None;
            }
        };
        fork.relid = Some(relid);
        if !unsafe { pg_sys::ConditionalLockRelationOid(relid, ACCESS_SHARE) } {
            fork.skip = Some(ForkSkip::LockedByReplay);
            return None;
        }
        let since = Instant::now();
        // Taking the lock accepted the invalidations replay sent before releasing its own
        // lock, so the catalog and relcache now show any DROP, TRUNCATE or rewrite.
        let relation = unsafe { pg_sys::try_relation_open(relid, NO_LOCK) };
        let skip = if relation.is_null() || !unsafe { compat::relation_has_storage(relation, fork.rel) } {
            Some(ForkSkip::RelationGone)
        } else if unsafe { (*(*relation).rd_rel).relkind } as u8 == pg_sys::RELKIND_SEQUENCE {
            Some(ForkSkip::Sequence)
        } else {
            match unsafe { (*(*relation).rd_rel).relpersistence } as u8 {
                pg_sys::RELPERSISTENCE_PERMANENT => None,
                pg_sys::RELPERSISTENCE_UNLOGGED if fork.rel.fork == INIT_FORK => None,
                pg_sys::RELPERSISTENCE_UNLOGGED => Some(ForkSkip::Unlogged),
                _ => Some(ForkSkip::RelationGone),
            }
        };
        if let Some(skip) = skip {
            if !relation.is_null() {
                unsafe { pg_sys::relation_close(relation, NO_LOCK) };
            }
            unsafe { pg_sys::UnlockRelationOid(relid, ACCESS_SHARE) };
            fork.skip = Some(skip);
            return None;
        }
        fork.exists = fork.exists || unsafe { compat::fork_exists(relation, fork.rel.fork) };
        let nblocks = if fork.exists { unsafe { compat::fork_nblocks(relation, fork.rel.fork) } } else { 0 };
        Some(LockedFork { relid, relation, nblocks, since })
    }

    fn release(self) {
        unsafe {
            pg_sys::relation_close(self.relation, NO_LOCK);
            pg_sys::UnlockRelationOid(self.relid, ACCESS_SHARE);
        }
    }
}

/// Where the run starting at `start` ends: the same fork, at most `READS_PER_LOCK` reads.
fn run_end(reads: &[Read], start: usize) -> usize {
    let fork = reads[start].fork;
    let limit = (start + READS_PER_LOCK).min(reads.len());
    (start..limit).find(|&index| reads[index].fork != fork).unwrap_or(limit)
}

/// Reads `reads` (one fork's, from read number `first` on) under one lock and returns how
/// many it dealt with: all of them, or fewer once the lock has been held `LOCK_HOLD`.
fn read_run(
    reads: &[Read],
    first: usize,
    fork: &mut ForkState,
    advise: bool,
    progress: &Progress,
    outcome: &mut Outcome,
) -> usize {
    pg_sys::check_for_interrupts!();
    // A promotion during the call ends it: on a primary these reads would race with
    // application backends instead of replay.
    require_recovery();
    if let Some(skip) = fork.skip {
        outcome.skip(skip, reads.len() as u64);
        return reads.len();
    }
    let Some(locked) = LockedFork::acquire(fork) else {
        outcome.skip(fork.skip.expect("acquire says why"), reads.len() as u64);
        return reads.len();
    };
    let in_file = |read: &Read| read.block < locked.nblocks;
    if advise {
        // The readahead threads are off: advise the first block of each stretch of
        // consecutive blocks (the kernel reads ahead of sequential reads by itself).
        let mut previous: Option<u32> = None;
        for read in reads.iter().filter(|read| in_file(read)) {
            if previous.and_then(|block| block.checked_add(1)) != Some(read.block) {
                unsafe { compat::prefetch(locked.relation, fork.rel.fork, read.block) };
            }
            previous = Some(read.block);
        }
    }
    let mut done = 0;
    let mut past_end = 0;
    let mut handed_out = 0u64;
    let mut pending = reads.iter();
    // Hands out the run's blocks in order, until the lock has been held LOCK_HOLD. Runs
    // inside a read stream on 17+: no PostgreSQL calls here.
    let mut next = || loop {
        if done > 0 && locked.since.elapsed() >= LOCK_HOLD {
            return None;
        }
        let read = pending.next()?;
        progress.reading(first + done);
        done += 1;
        if !in_file(read) {
            past_end += 1;
            continue;
        }
        handed_out += 1;
        return Some((read.block, read.usage));
    };
    let cached = unsafe {
        compat::stream_reads(locked.relation, fork.rel.fork, &mut next, |buffer, usage| {
            buffers::raise_usage_count(buffer, usage);
            pg_sys::ReleaseBuffer(buffer);
            pg_sys::check_for_interrupts!();
        })
    };
    outcome.already_cached += cached.min(handed_out);
    outcome.loaded += handed_out - cached.min(handed_out);
    outcome.skipped_past_end += past_end;
    failpoints::prewarm_delay();
    locked.release();
    done
}

/// The file ranges the readahead threads should read, in the order of `reads`.
fn readahead_plan(reads: &[Read], forks: &[ForkState]) -> ReadaheadPlan {
    let mut plan = ReadaheadPlan::try_with_capacity(forks.len(), reads.len()).unwrap_or_else(|_| {
        errors::out_of_memory("the readahead plan", (reads.len() * 32 + forks.len() * 64) as u64)
    });
    let mut paths: Vec<Option<usize>> = try_vec(forks.len(), None, "the readahead plan");
    for (index, read) in reads.iter().enumerate() {
        let fork = &forks[read.fork as usize];
        let path = *paths[read.fork as usize].get_or_insert_with(|| plan.add_fork(compat::relation_path(fork.rel)));
        plan.push(path, read.block, index);
    }
    plan
}

/// `len` copies of `value`, or the out-of-memory ERROR.
fn try_vec<T: Clone>(len: usize, value: T, what: &str) -> Vec<T> {
    let mut vec = Vec::new();
    if vec.try_reserve_exact(len).is_err() {
        errors::out_of_memory(what, (len * std::mem::size_of::<T>()) as u64);
    }
    vec.resize(len, value);
    vec
}

/// Reads every planned block, one locked run at a time.
fn read_all(reads: &[Read], forks: &mut [ForkState], outcome: &mut Outcome) {
    // On 17+ a read stream keeps reads in flight within each locked run; the threads also
    // advise the kernel across runs, up to their window ahead (BENCHMARKS.md measures both).
    let threads = usize::try_from(gucs::PREWARM_READAHEAD_THREADS.get()).unwrap_or(0);
    let plan = if threads > 0 { readahead_plan(reads, forks) } else { ReadaheadPlan::default() };
    plan.run(threads, |progress| {
        let mut next = 0;
        while next < reads.len() {
            let end = run_end(reads, next);
            let fork = &mut forks[reads[next].fork as usize];
            let advise = threads == 0 && !compat::HAS_READ_STREAMS;
            next += read_run(&reads[next..end], next, fork, advise, progress, outcome);
        }
    });
}

/// Blocks one ccm_prewarm() call reads at most, whatever shared_buffers is: a call's Rust
/// heap (the decoded list, its reads and the read-ahead plan, about 57 bytes a block) is
/// outside palloc's accounting, so it is bounded here (about 60 MB) rather than by the pool
/// (0.9 GB on a 128 GB pool). ccm-agent sends at most this many per call (batch_blocks).
pub(crate) const MAX_BLOCKS_PER_CALL: u64 = 1 << 20;

/// Blocks one call accepts on this node: at most its buffers and MAX_BLOCKS_PER_CALL.
pub(crate) fn call_limit() -> u64 {
    (buffers::buffer_count() as u64).min(MAX_BLOCKS_PER_CALL)
}

/// Decodes a list of at most call_limit() blocks or raises the ERROR (54000 above it).
pub(crate) fn decode(list: &[u8]) -> BlockList {
    let limit = call_limit();
    BlockList::decode_bounded(list, limit).unwrap_or_else(|error| {
        errors::block_list_refused(
            &error,
            &format!(
                "ccm_prewarm() accepts lists of up to {limit} blocks, the smaller of the buffers of shared_buffers and {MAX_BLOCKS_PER_CALL}."
            ),
        )
    })
}

/// Reads, in this process, the blocks of the list's forks whose database `here` accepts
/// (the caller's database and the shared catalogs, or a worker's database); the other
/// forks are left alone and not counted.
pub(crate) fn read_blocks(list: &BlockList, here: impl Fn(u32) -> bool) -> Outcome {
    let mut forks: Vec<ForkState> = Vec::new();
    if forks.try_reserve_exact(list.groups.len()).is_err() {
        errors::out_of_memory("the forks of a block list", (list.groups.len() * std::mem::size_of::<ForkState>()) as u64);
    }
    forks.extend(list.groups.iter().map(|group| ForkState {
        rel: group.rel,
        relid: None,
        skip: (!here(group.rel.db)).then_some(ForkSkip::OtherDatabase),
        exists: false,
    }));
    let reads = plan_reads(list, &forks);
    let mut outcome = Outcome::default();
    read_all(&reads, &mut forks, &mut outcome);
    outcome
}

/// Reads the blocks of a list made by ccm_hot_blocks() into shared_buffers.
#[pg_extern(volatile, parallel_unsafe)]
fn ccm_prewarm(
    list: &[u8],
) -> TableIterator<
    'static,
    (
        name!(requested, i64),
        name!(loaded, i64),
        name!(already_cached, i64),
        name!(skipped, i64),
    ),
> {
    errors::require_enabled();
    require_recovery();
    // No list can name more blocks than this node has buffers, nor more than a call's bound.
    let decoded = decode(list);

    let here = unsafe { pg_sys::MyDatabaseId }.to_u32();
    let mut outcome = read_blocks(&decoded, |db| db == here || db == 0);
    for (db, blocks) in prewarm_worker::other_databases(&decoded, here) {
        outcome.add(&prewarm_worker::prewarm_database(db, blocks, list));
    }

    debug1!(
        "pg_ccm prewarm: {} requested, {} loaded, {} already cached, skipped {} (relation gone {}, past end of file {}, unlogged {}, sequence {}, locked by replay {}, database not reachable {}, unknown database {})",
        decoded.len(),
        outcome.loaded,
        outcome.already_cached,
        outcome.skipped(),
        outcome.skipped_relation_gone,
        outcome.skipped_past_end,
        outcome.skipped_unlogged,
        outcome.skipped_sequence,
        outcome.skipped_locked,
        outcome.skipped_other_database,
        outcome.skipped_unknown_database,
    );
    TableIterator::once((
        decoded.len() as i64,
        outcome.loaded as i64,
        outcome.already_cached as i64,
        outcome.skipped() as i64,
    ))
}
