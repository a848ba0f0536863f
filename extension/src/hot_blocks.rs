//! The primary's side of the loop: which cached blocks are hot, and which of those the
//! standby lacks.
//!
//! `ccm_hot_blocks()` scans every buffer header once, keeps WAL-logged pages whose usage
//! count is above `ccm.usage_threshold`, drops those the standby's filter says it has,
//! and returns them as a packed block list; with `max_blocks`, only those among the
//! `max_blocks` hottest blocks of the whole hot set.
//! `ccm_hot_blocks_each()` serves several standbys with one scan: one filter and one
//! list per standby, the primary's cost growing only by a filter probe per hot buffer.
//! They are the scans `aurora_ccm_status()` reports on, when they run at the configured
//! `ccm.usage_threshold`: a scan at another threshold (the agent's look below it, to fill a
//! standby's unused buffers) would make the counters mean something else, and leaves them
//! alone, as `ccm_hot_buffers()`, which shows the same set as rows, always does.

use ccm_codec::{encode_block_list, FilterView, HotBlock, MAX_FORK};
use pgrx::prelude::*;

use crate::block_list::block_row;
use crate::buffers;
use crate::catalog_oid::CatalogOid;
use crate::errors;
use crate::filter::parse_filter;
use crate::gucs;
use crate::shmem::{self, ScanCounts};

/// Buffers visited between two progress reports to shared memory.
const PROGRESS_INTERVAL: usize = 16384;

/// Most standbys one scan serves: each candidate keeps one bit per filter.
const MAX_STANDBYS: usize = 64;

/// The most the lists of one call may hold together: PostgreSQL's limit of one allocation
/// (MaxAllocSize), which the bytea[] result could not exceed anyway. Checked as each list is
/// made, so that 64 standbys cannot make one call hold 64 full lists.
const MAX_RESULT_BYTES: usize = 0x3fff_ffff;

/// A hot buffer found by a scan, and which standbys' filters say they have it (bit i:
/// filter i).
#[derive(Clone, Copy)]
struct Candidate {
    block: HotBlock,
    on_standby: u64,
}

/// Outcome of one scan.
struct HotSet {
    candidates: Vec<Candidate>,
    /// Whether `candidates` is in send order (hottest first, then by address).
    ordered: bool,
    found: u64,
    visited: u64,
}

impl HotSet {
    /// The blocks to send to standby `index`: of the `limit` hottest, those it lacks.
    ///
    /// The cap picks from the whole hot set, not from what is missing, so that a standby
    /// too small for the hot set converges on holding its hottest part instead of trading
    /// blocks back and forth every cycle. Ties go to the lower address, so the choice is
    /// the same from one scan to the next.
    fn to_send(&mut self, index: usize, limit: usize) -> Vec<HotBlock> {
        let bit = 1u64 << index;
        let mut hottest = &self.candidates[..];
        if hottest.len() > limit {
            if !self.ordered {
                self.candidates.sort_unstable_by(|a, b| {
                    b.block.usage.cmp(&a.block.usage).then(a.block.addr.cmp(&b.block.addr))
                });
                self.ordered = true;
            }
            hottest = &self.candidates[..limit];
        }
        let lacking = || hottest.iter().filter(|c| c.on_standby & bit == 0).map(|c| c.block);
        let mut blocks = Vec::new();
        let count = lacking().count();
        if blocks.try_reserve_exact(count).is_err() {
            errors::out_of_memory("a hot block list", (count * std::mem::size_of::<HotBlock>()) as u64);
        }
        blocks.extend(lacking());
        blocks
    }
}

/// The threshold of a call, and whether it is the configured one (whose scans
/// aurora_ccm_status() reports).
fn resolve_threshold(usage_threshold: Option<i32>) -> (u8, bool) {
    let configured = gucs::USAGE_THRESHOLD.get();
    let threshold = usage_threshold.unwrap_or(configured);
    if !(0..=gucs::MAX_USAGE_THRESHOLD).contains(&threshold) {
        errors::invalid_argument(
            format!("invalid usage_threshold: {threshold}"),
            Some(format!("The threshold ranges from 0 to {}.", gucs::MAX_USAGE_THRESHOLD)),
        );
    }
    (threshold as u8, threshold == configured)
}

fn resolve_max_blocks(max_blocks: Option<i64>) -> usize {
    match max_blocks {
        None => usize::MAX,
        Some(limit) if limit >= 0 => usize::try_from(limit).unwrap_or(usize::MAX),
        Some(limit) => errors::invalid_argument(
            format!("invalid max_blocks: {limit}"),
            Some("max_blocks must be zero or positive, or NULL for no limit.".into()),
        ),
    }
}

/// Scans shared_buffers for hot, permanent blocks, noting which filters contain each.
/// Blocks every standby has are kept only when a limit may cut the hot set (they compete
/// for its places). `report` publishes progress to aurora_ccm_status(), counted against
/// the first filter (the tier-0 standby's).
fn scan_hot_set(filters: &[Option<FilterView<'_>>], threshold: u8, limits: &[usize], report: bool) -> HotSet {
    let count = buffers::buffer_count();
    let keep_cached = limits.iter().any(|&limit| limit < count);
    let everywhere = if filters.len() >= 64 { u64::MAX } else { (1u64 << filters.len()) - 1 };
    let mut progress = ScanCounts::default();
    let mut candidates = Vec::new();
    for index in 0..count {
        if index % PROGRESS_INTERVAL == 0 && index > 0 {
            pg_sys::check_for_interrupts!();
            if report {
                shmem::scan_progress(progress, index as u64);
            }
        }
        let Some(buffer) = buffers::read_header(index) else { continue };
        // Unlogged and temporary pages do not exist on a standby.
        if buffer.usage <= threshold || !buffer.permanent || buffer.address.fork > MAX_FORK {
            continue;
        }
        let mut on_standby = 0u64;
        for (i, filter) in filters.iter().enumerate() {
            if filter.as_ref().is_some_and(|filter| filter.contains(&buffer.address)) {
                on_standby |= 1 << i;
            }
        }
        progress.found += 1;
        progress.sent += u64::from(on_standby & 1 == 0);
        if on_standby == everywhere && !keep_cached {
            continue;
        }
        if candidates.len() == candidates.capacity() && candidates.try_reserve(candidates.len().max(1024)).is_err() {
            errors::out_of_memory("the hot set", (candidates.len() * 2 * std::mem::size_of::<Candidate>()) as u64);
        }
        candidates.push(Candidate {
            block: HotBlock { addr: buffer.address, usage: buffer.usage },
            on_standby,
        });
    }
    HotSet { candidates, ordered: false, found: progress.found, visited: count as u64 }
}

/// Packed list of the hot blocks (usage count above the threshold) that `filter` lacks.
#[pg_extern(volatile, parallel_unsafe)]
fn ccm_hot_blocks(
    filter: default!(Option<&[u8]>, "NULL"),
    max_blocks: default!(Option<i64>, "NULL"),
    usage_threshold: default!(Option<i32>, "NULL"),
) -> Vec<u8> {
    errors::require_enabled();
    let view = filter.map(parse_filter);
    let (threshold, report) = resolve_threshold(usage_threshold);
    let limit = resolve_max_blocks(max_blocks);
    hot_lists(&[view], threshold, &[limit], report).pop().expect("one list per filter")
}

/// One scan for several standbys: for each filter (NULL: nothing known about that
/// standby), the packed list of the hot blocks it lacks among its `max_blocks` hottest
/// (NULL: no limit), in the order of the filters. aurora_ccm_status() counts the first.
#[pg_extern(volatile, parallel_unsafe)]
fn ccm_hot_blocks_each(
    filters: Array<'_, &[u8]>,
    max_blocks: Array<'_, i64>,
    usage_threshold: default!(Option<i32>, "NULL"),
) -> Vec<Vec<u8>> {
    errors::require_enabled();
    if filters.is_empty() || filters.len() > MAX_STANDBYS {
        errors::invalid_argument(
            format!("invalid number of filters: {}", filters.len()),
            Some(format!("One scan serves from 1 to {MAX_STANDBYS} standbys.")),
        );
    }
    if max_blocks.len() != filters.len() {
        errors::invalid_argument(
            format!("max_blocks has {} elements, filters has {}", max_blocks.len(), filters.len()),
            Some("Give one max_blocks element (NULL for no limit) per filter.".into()),
        );
    }
    let views: Vec<_> = filters.iter().map(|filter| filter.map(parse_filter)).collect();
    let (threshold, report) = resolve_threshold(usage_threshold);
    let limits: Vec<_> = max_blocks.iter().map(resolve_max_blocks).collect();
    hot_lists(&views, threshold, &limits, report)
}

/// The scan behind ccm_hot_blocks() and ccm_hot_blocks_each(): one list per filter.
/// `report`: the scan counts in aurora_ccm_status().
fn hot_lists(filters: &[Option<FilterView<'_>>], threshold: u8, limits: &[usize], report: bool) -> Vec<Vec<u8>> {
    if report {
        shmem::scan_started();
    }
    let mut hot = scan_hot_set(filters, threshold, limits, report);
    let (found, visited) = (hot.found, hot.visited);
    let mut lists = Vec::with_capacity(filters.len());
    let mut total = 0usize;
    for (index, &limit) in limits.iter().enumerate() {
        let mut blocks = hot.to_send(index, limit);
        if index == 0 && report {
            shmem::scan_finished(ScanCounts { sent: blocks.len() as u64, found }, visited);
        }
        let list = encode_block_list(&mut blocks, found, visited).unwrap_or_else(|error| errors::encode_failed(&error));
        total += list.len();
        if total > MAX_RESULT_BYTES {
            errors::raise(
                PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
                format!("the hot block lists of {} standbys exceed 1 GB", limits.len()),
                Some(format!("The first {} lists hold {total} bytes.", index + 1)),
                Some("Ask for fewer standbys per call, or cap their max_blocks."),
            );
        }
        lists.push(list);
    }
    lists
}

/// The hot set as rows, one per block, with its usage count. Read-only: the
/// aurora_ccm_status() counters are not touched.
#[pg_extern(volatile, parallel_safe)]
fn ccm_hot_buffers(
    filter: default!(Option<&[u8]>, "NULL"),
    usage_threshold: default!(Option<i32>, "NULL"),
) -> TableIterator<
    'static,
    (
        name!(reltablespace, CatalogOid),
        name!(reldatabase, CatalogOid),
        name!(relfilenode, CatalogOid),
        name!(relforknumber, i16),
        name!(relblocknumber, i64),
        name!(usagecount, i16),
    ),
> {
    let view = filter.map(parse_filter);
    let (threshold, _) = resolve_threshold(usage_threshold);
    let mut blocks = scan_hot_set(&[view], threshold, &[usize::MAX], false).to_send(0, usize::MAX);
    blocks.sort_unstable_by_key(|block| block.addr);
    TableIterator::new(blocks.into_iter().map(block_row))
}
