//! The primary's side of the loop: which cached blocks are hot, and which of those the
//! standby lacks.
//!
//! `ccm_hot_blocks()` scans every buffer header once, keeps WAL-logged pages whose usage
//! count is above `ccm.usage_threshold`, drops those the standby's filter says it has,
//! and returns them as a packed block list; with `max_blocks`, only those among the
//! `max_blocks` hottest blocks of the whole hot set.
//! It is the scan `aurora_ccm_status()` reports on. `ccm_hot_buffers()` shows the same
//! set as rows and leaves the counters alone.

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

/// A hot buffer found by a scan, and whether the standby's filter says it has it.
#[derive(Clone, Copy)]
struct Candidate {
    block: HotBlock,
    on_standby: bool,
}

/// Outcome of one scan.
struct HotSet {
    candidates: Vec<Candidate>,
    found: u64,
    visited: u64,
}

impl HotSet {
    /// The blocks to send: of the `limit` hottest, those the standby lacks.
    ///
    /// The cap picks from the whole hot set, not from what is missing, so that a standby
    /// too small for the hot set converges on holding its hottest part instead of trading
    /// blocks back and forth every cycle. Ties go to the lower address, so the choice is
    /// the same from one scan to the next.
    fn to_send(mut self, limit: usize) -> Vec<HotBlock> {
        if self.candidates.len() > limit {
            let order = |a: &Candidate, b: &Candidate| {
                b.block.usage.cmp(&a.block.usage).then(a.block.addr.cmp(&b.block.addr))
            };
            if limit > 0 {
                self.candidates.select_nth_unstable_by(limit - 1, order);
            }
            self.candidates.truncate(limit);
        }
        self.candidates.into_iter().filter(|c| !c.on_standby).map(|c| c.block).collect()
    }
}

fn resolve_threshold(usage_threshold: Option<i32>) -> u8 {
    let threshold = usage_threshold.unwrap_or_else(|| gucs::USAGE_THRESHOLD.get());
    if !(0..=gucs::MAX_USAGE_THRESHOLD).contains(&threshold) {
        errors::invalid_argument(
            format!("invalid usage_threshold: {threshold}"),
            Some(format!("The threshold ranges from 0 to {}.", gucs::MAX_USAGE_THRESHOLD)),
        );
    }
    threshold as u8
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

/// Scans shared_buffers for hot, permanent blocks, noting which ones the filter contains.
/// Blocks the standby has are kept only when `limit` may cut the hot set (they compete
/// for its places). `report` publishes progress to aurora_ccm_status().
fn scan_hot_set(filter: Option<&FilterView<'_>>, threshold: u8, limit: usize, report: bool) -> HotSet {
    let count = buffers::buffer_count();
    let keep_cached = limit < count;
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
        let on_standby = filter.is_some_and(|filter| filter.contains(&buffer.address));
        progress.found += 1;
        progress.sent += u64::from(!on_standby);
        if on_standby && !keep_cached {
            continue;
        }
        candidates.push(Candidate {
            block: HotBlock { addr: buffer.address, usage: buffer.usage },
            on_standby,
        });
    }
    HotSet { candidates, found: progress.found, visited: count as u64 }
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
    let threshold = resolve_threshold(usage_threshold);
    let limit = resolve_max_blocks(max_blocks);

    shmem::scan_started();
    let hot = scan_hot_set(view.as_ref(), threshold, limit, true);
    let (found, visited) = (hot.found, hot.visited);
    let mut blocks = hot.to_send(limit);
    shmem::scan_finished(ScanCounts { sent: blocks.len() as u64, found }, visited);

    encode_block_list(&mut blocks, found, visited)
        .expect("blocks from buffer headers are valid list entries")
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
    let threshold = resolve_threshold(usage_threshold);
    let mut blocks = scan_hot_set(view.as_ref(), threshold, usize::MAX, false).to_send(usize::MAX);
    blocks.sort_unstable_by_key(|block| block.addr);
    TableIterator::new(blocks.into_iter().map(block_row))
}
