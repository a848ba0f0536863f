//! The standby's side of the loop: read the listed blocks into shared_buffers.
//!
//! Blocks are read hottest first, so that when shared_buffers cannot hold the whole
//! list the clock sweep evicts the colder ones, and each loaded buffer gets a usage
//! count at least the primary's (capped at BM_MAX_USAGE_COUNT), so that after promotion
//! the sweep evicts cold pages before these. Readahead threads (readahead.rs) advise the
//! kernel of upcoming blocks ahead of the reads, which turns a scattered list into
//! parallel I/O.
//!
//! No lock is taken: replay must never wait for us. Replay may therefore drop or
//! truncate a relation while we read it. Blocks of relations that are gone, past the end
//! of their file, unlogged (a standby has only their init fork) or in an unknown
//! database are skipped and counted, never an error. Reads run in subtransactions of a
//! bounded size so that a file vanishing under a read costs that one block, and at the
//! end every fork we loaded into is checked again: buffers of blocks that no longer
//! exist are dropped, so no stale page outlives its relation.

use std::cell::Cell;
use std::cmp::Reverse;
use std::panic::AssertUnwindSafe;

use ccm_codec::{BlockList, RelFork};
use pgrx::pg_sys::panic::CaughtError;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;

use crate::buffers;
use crate::compat;
use crate::errors;
use crate::failpoints;
use crate::gucs;
use crate::readahead::{Progress, ReadaheadPlan};

/// How far posix_fadvise runs ahead of the reads, in blocks (readahead threads off).
const PREFETCH_DISTANCE: usize = 128;
/// Reads per subtransaction: small enough that a failure costs little, large enough
/// that starting subtransactions costs nothing measurable.
const READS_PER_SUBTRANSACTION: usize = 1024;

const MAIN_FORK: u8 = pg_sys::ForkNumber::MAIN_FORKNUM as u8;
const INIT_FORK: u8 = pg_sys::ForkNumber::INIT_FORKNUM as u8;

/// What happened to the requested blocks; every block is counted exactly once.
#[derive(Clone, Copy, Debug, Default)]
struct Outcome {
    loaded: u64,
    already_cached: u64,
    skipped_relation_gone: u64,
    skipped_past_end: u64,
    skipped_unlogged: u64,
    skipped_unknown_database: u64,
    stale_buffers_dropped: u64,
}

impl Outcome {
    fn skipped(&self) -> u64 {
        self.skipped_relation_gone
            + self.skipped_past_end
            + self.skipped_unlogged
            + self.skipped_unknown_database
    }
}

/// Why a whole fork is skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ForkSkip {
    RelationGone,
    Unlogged,
    UnknownDatabase,
}

/// A fork of the list, as found on this node.
struct ForkState {
    rel: RelFork,
    /// Blocks on disk when we looked; `None` when the whole fork is skipped.
    nblocks: Option<u32>,
    skip: Option<ForkSkip>,
    /// Highest block this call read from disk, for the final stale-buffer check.
    highest_loaded: Option<u32>,
}

/// One block to read.
#[derive(Clone, Copy)]
struct Read {
    fork: u32,
    block: u32,
    usage: u8,
}

fn is_storage_error(error: &CaughtError) -> bool {
    let code = match error {
        CaughtError::PostgresError(report) | CaughtError::ErrorReport(report) => {
            report.sql_error_code()
        }
        CaughtError::RustPanic { .. } => return false,
    };
    matches!(
        code,
        PgSqlErrorCode::ERRCODE_UNDEFINED_FILE
            | PgSqlErrorCode::ERRCODE_DATA_CORRUPTED
            | PgSqlErrorCode::ERRCODE_IO_ERROR
    )
}

/// Runs `work` in an internal subtransaction. A storage error (file gone, short read,
/// corrupt page) rolls it back, which releases any pin it held, and yields `None`;
/// every other error, a query cancel included, is raised again.
fn in_subtransaction<T>(work: impl FnOnce() -> T) -> Option<T> {
    let context = unsafe { pg_sys::CurrentMemoryContext };
    let owner = unsafe { pg_sys::CurrentResourceOwner };
    unsafe {
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
    }
    let restore = move || unsafe {
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
    };
    PgTryBuilder::new(AssertUnwindSafe(|| {
        let value = work();
        unsafe { pg_sys::ReleaseCurrentSubTransaction() };
        restore();
        Some(value)
    }))
    .catch_others(|error| {
        unsafe { pg_sys::RollbackAndReleaseCurrentSubTransaction() };
        restore();
        if is_storage_error(&error) {
            None
        } else {
            error.rethrow()
        }
    })
    .execute()
}

fn database_exists(db: u32) -> bool {
    // Database 0 holds the shared catalogs.
    db == 0
        || unsafe {
            pg_sys::SearchSysCacheExists(
                pg_sys::SysCacheIdentifier::DATABASEOID as i32,
                pg_sys::Datum::from(db),
                pg_sys::Datum::from(0),
                pg_sys::Datum::from(0),
                pg_sys::Datum::from(0),
            )
        }
}

/// Looks a fork up on disk once, before any read.
fn probe_fork(rel: RelFork) -> ForkState {
    let skipped = |skip| ForkState { rel, nblocks: None, skip: Some(skip), highest_loaded: None };
    if !database_exists(rel.db) {
        return skipped(ForkSkip::UnknownDatabase);
    }
    let nblocks = in_subtransaction(|| {
        compat::fork_exists(rel, rel.fork).then(|| compat::fork_nblocks(rel))
    })
    .flatten();
    match nblocks {
        Some(nblocks) => ForkState { rel, nblocks: Some(nblocks), skip: None, highest_loaded: None },
        None if rel.fork == MAIN_FORK && compat::fork_exists(rel, INIT_FORK) => {
            skipped(ForkSkip::Unlogged)
        }
        None => skipped(ForkSkip::RelationGone),
    }
}

/// Counts the blocks that cannot be read and returns the rest, hottest first.
fn plan_reads(list: &BlockList, forks: &[ForkState], outcome: &mut Outcome) -> Vec<Read> {
    let mut reads = Vec::with_capacity(list.len());
    for (index, (group, fork)) in list.groups.iter().zip(forks).enumerate() {
        let skipped = group.blocks.len() as u64;
        match (fork.skip, fork.nblocks) {
            (Some(ForkSkip::RelationGone), _) => outcome.skipped_relation_gone += skipped,
            (Some(ForkSkip::Unlogged), _) => outcome.skipped_unlogged += skipped,
            (Some(ForkSkip::UnknownDatabase), _) => outcome.skipped_unknown_database += skipped,
            (None, nblocks) => {
                let nblocks = nblocks.unwrap_or(0);
                for (&block, &usage) in group.blocks.iter().zip(&group.usage) {
                    if block < nblocks {
                        reads.push(Read { fork: index as u32, block, usage });
                    } else {
                        outcome.skipped_past_end += 1;
                    }
                }
            }
        }
    }
    // Stable: within one usage count, reads stay in file order.
    reads.sort_by_key(|read| Reverse(read.usage));
    reads
}

/// posix_fadvise(WILLNEED) prefetching from the backend, used when the readahead
/// threads are off. Only the first block of a run is advised: the kernel reads ahead of
/// sequential reads by itself, and advising each block would split them into 8 kB I/Os.
struct Prefetcher {
    enabled: bool,
    next: usize,
}

impl Prefetcher {
    fn advise_up_to(&mut self, horizon: usize, reads: &[Read], forks: &[ForkState]) {
        if !self.enabled {
            return;
        }
        while self.next < horizon.min(reads.len()) {
            let read = reads[self.next];
            let follows = self.next > 0 && {
                let previous = reads[self.next - 1];
                previous.fork == read.fork && previous.block.checked_add(1) == Some(read.block)
            };
            self.next += 1;
            let fork = &forks[read.fork as usize];
            if !follows && fork.skip.is_none() {
                compat::prefetch(&fork.rel.block(read.block));
            }
        }
    }
}

/// Reads `reads[start..end]`, stopping at the first storage error. `position` tells the
/// caller how far it got.
#[allow(clippy::too_many_arguments)]
fn read_range(
    reads: &[Read],
    forks: &mut [ForkState],
    start: usize,
    end: usize,
    prefetcher: &mut Prefetcher,
    progress: &Progress,
    position: &Cell<usize>,
    outcome: &mut Outcome,
) {
    for index in start..end {
        position.set(index);
        progress.reading(index);
        let read = reads[index];
        if forks[read.fork as usize].skip.is_some() {
            outcome.skipped_relation_gone += 1;
            continue;
        }
        prefetcher.advise_up_to(index + PREFETCH_DISTANCE, reads, forks);
        pg_sys::check_for_interrupts!();

        let fork = &mut forks[read.fork as usize];
        let address = fork.rel.block(read.block);
        let hits_before = unsafe { pg_sys::pgBufferUsage.shared_blks_hit };
        let buffer = compat::read_buffer(&address);
        let was_cached = unsafe { pg_sys::pgBufferUsage.shared_blks_hit } != hits_before;
        buffers::raise_usage_count(buffer, read.usage);
        unsafe { pg_sys::ReleaseBuffer(buffer) };

        if was_cached {
            outcome.already_cached += 1;
        } else {
            outcome.loaded += 1;
            fork.highest_loaded = Some(fork.highest_loaded.map_or(read.block, |h| h.max(read.block)));
        }
    }
    position.set(end);
}

/// The file ranges the readahead threads should read, in the order of `reads`.
fn readahead_plan(reads: &[Read], forks: &[ForkState]) -> ReadaheadPlan {
    let mut plan = ReadaheadPlan::default();
    let mut paths: Vec<Option<usize>> = vec![None; forks.len()];
    for (index, read) in reads.iter().enumerate() {
        let fork = &forks[read.fork as usize];
        let path = *paths[read.fork as usize].get_or_insert_with(|| plan.add_fork(compat::relation_path(fork.rel)));
        plan.push(path, read.block, index);
    }
    plan
}

/// Reads every planned block; a storage error skips that block and the rest of its fork.
fn read_all(reads: &[Read], forks: &mut [ForkState], outcome: &mut Outcome) {
    let threads = usize::try_from(gucs::PREWARM_READAHEAD_THREADS.get()).unwrap_or(0);
    let plan = if threads > 0 { readahead_plan(reads, forks) } else { ReadaheadPlan::default() };
    plan.run(threads, |progress| {
        let mut prefetcher = Prefetcher { enabled: threads == 0, next: 0 };
        let mut next = 0;
        while next < reads.len() {
            let end = (next + READS_PER_SUBTRANSACTION).min(reads.len());
            let position = Cell::new(next);
            let finished = in_subtransaction(|| {
                read_range(reads, forks, next, end, &mut prefetcher, progress, &position, outcome)
            });
            if finished.is_some() {
                next = end;
            } else {
                // The file vanished (or the page is unreadable) under this read.
                let failed = position.get();
                forks[reads[failed].fork as usize].skip = Some(ForkSkip::RelationGone);
                outcome.skipped_relation_gone += 1;
                next = failed + 1;
            }
        }
    });
}

/// Drops buffers we loaded for blocks that replay removed while we were reading them
/// (relation dropped, or truncated by VACUUM), which replay's own buffer drop may have
/// run before our read.
fn drop_stale_buffers(forks: &[ForkState], outcome: &mut Outcome) {
    if forks.iter().all(|fork| fork.highest_loaded.is_none()) {
        return;
    }
    failpoints::prewarm_delay();
    unsafe { pg_sys::AcceptInvalidationMessages() };
    for fork in forks {
        let Some(highest) = fork.highest_loaded else { continue };
        let nblocks_now = in_subtransaction(|| {
            if compat::fork_exists(fork.rel, fork.rel.fork) {
                compat::fork_nblocks(fork.rel)
            } else {
                0
            }
        })
        .unwrap_or(0);
        if highest >= nblocks_now {
            failpoints::prewarm_delay();
            compat::drop_buffers_from(fork.rel, nblocks_now);
            outcome.stale_buffers_dropped += u64::from(highest - nblocks_now) + 1;
        }
    }
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
    let list = BlockList::decode(list).unwrap_or_else(|error| errors::invalid_input("block list", &error));

    let mut outcome = Outcome::default();
    let mut forks: Vec<ForkState> = list.groups.iter().map(|group| probe_fork(group.rel)).collect();
    let reads = plan_reads(&list, &forks, &mut outcome);
    read_all(&reads, &mut forks, &mut outcome);
    drop_stale_buffers(&forks, &mut outcome);

    debug1!(
        "pg_ccm prewarm: {} requested, {} loaded, {} already cached, skipped {} (relation gone {}, past end of file {}, unlogged {}, unknown database {}), {} stale buffers dropped",
        list.len(),
        outcome.loaded,
        outcome.already_cached,
        outcome.skipped(),
        outcome.skipped_relation_gone,
        outcome.skipped_past_end,
        outcome.skipped_unlogged,
        outcome.skipped_unknown_database,
        outcome.stale_buffers_dropped,
    );
    TableIterator::once((
        list.len() as i64,
        outcome.loaded as i64,
        outcome.already_cached as i64,
        outcome.skipped() as i64,
    ))
}
