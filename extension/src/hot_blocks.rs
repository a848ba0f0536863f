//! The primary's side of the loop: which cached blocks are hot, and which of those the
//! standby lacks.
//!
//! `ccm_hot_blocks()` scans every buffer header once, keeps WAL-logged pages whose usage
//! count is above `ccm.usage_threshold`, drops those the standby's filter says it has,
//! keeps the hottest `max_blocks` if asked to, and returns them as a packed block list.
//! It is the scan `aurora_ccm_status()` reports on. `ccm_hot_buffers()` shows the same
//! set as rows and leaves the counters alone.

use ccm_codec::{encode_block_list, FilterView, HotBlock, MAX_FORK};
use pgrx::prelude::*;

use crate::buffers;
use crate::catalog_oid::CatalogOid;
use crate::errors;
use crate::filter::parse_filter;
use crate::gucs;
use crate::shmem::{self, ScanCounts};

/// Buffers visited between two progress reports to shared memory.
const PROGRESS_INTERVAL: usize = 16384;

/// Outcome of one scan.
struct HotSet {
    /// Hot blocks the filter lacks, at most `max_blocks`, hottest kept.
    blocks: Vec<HotBlock>,
    counts: ScanCounts,
    visited: u64,
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

/// Scans shared_buffers for hot, permanent blocks the filter does not contain.
/// `report` publishes progress to aurora_ccm_status().
fn scan_hot_set(filter: Option<&FilterView<'_>>, threshold: u8, report: bool) -> HotSet {
    let count = buffers::buffer_count();
    let mut counts = ScanCounts::default();
    let mut blocks = Vec::new();
    for index in 0..count {
        if index % PROGRESS_INTERVAL == 0 && index > 0 {
            pg_sys::check_for_interrupts!();
            if report {
                shmem::scan_progress(counts, index as u64);
            }
        }
        let Some(buffer) = buffers::read_header(index) else { continue };
        // Unlogged and temporary pages do not exist on a standby.
        if buffer.usage <= threshold || !buffer.permanent || buffer.address.fork > MAX_FORK {
            continue;
        }
        counts.found += 1;
        if filter.is_some_and(|filter| filter.contains(&buffer.address)) {
            continue;
        }
        counts.sent += 1;
        blocks.push(HotBlock { addr: buffer.address, usage: buffer.usage });
    }
    HotSet { blocks, counts, visited: count as u64 }
}

/// Keeps the `limit` hottest blocks.
fn keep_hottest(blocks: &mut Vec<HotBlock>, limit: usize) {
    if blocks.len() > limit {
        if limit > 0 {
            blocks.select_nth_unstable_by(limit - 1, |a, b| b.usage.cmp(&a.usage));
        }
        blocks.truncate(limit);
    }
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
    let mut hot = scan_hot_set(view.as_ref(), threshold, true);
    keep_hottest(&mut hot.blocks, limit);
    hot.counts.sent = hot.blocks.len() as u64;
    shmem::scan_finished(hot.counts, hot.visited);

    encode_block_list(&mut hot.blocks, hot.counts.found, hot.visited)
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
    let mut hot = scan_hot_set(view.as_ref(), threshold, false);
    hot.blocks.sort_unstable_by_key(|block| block.addr);
    TableIterator::new(hot.blocks.into_iter().map(|block| {
        (
            CatalogOid(block.addr.spc),
            CatalogOid(block.addr.db),
            CatalogOid(block.addr.rel),
            i16::from(block.addr.fork),
            i64::from(block.addr.block),
            i16::from(block.usage),
        )
    }))
}
