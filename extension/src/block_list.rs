//! Inspecting packed block lists from SQL: `ccm_block_list_info()` and
//! `ccm_unpack_block_list()`.
//!
//! Both are granted to `pg_monitor`, so their input is untrusted. A list's header may
//! declare up to two blocks per input byte; neither function materialises the blocks:
//!
//! - the list is validated in place (`BlockListView`, every field, no allocation) before
//!   anything else happens, so malformed input raises an ERROR and no row is emitted;
//! - `ccm_block_list_info()` then reads only the header;
//! - `ccm_unpack_block_list()` streams one row per call (value-per-call SRF) from the
//!   detoasted argument, which PostgreSQL keeps for the whole SRF call, so its memory is
//!   the input plus one row, whatever the block count;
//! - both refuse a list that declares more than [`inspect_limit`] blocks (54000
//!   program_limit_exceeded), which caps the time a call can spend emitting rows.
//!
//! [`raise_block_list_error`] maps every codec error to its SQLSTATE (22P03 malformed,
//! 54000 over a limit, 53200 out of memory), for every SQL entry point that reads a list.

use ccm_codec::{BlockListHeader, BlockListView, HotBlock};
use pgrx::prelude::*;

use crate::buffers;
use crate::catalog_oid::CatalogOid;
use crate::errors;

/// The inspection functions accept at least this many blocks: a hot set of 128 GB.
pub const INSPECT_MIN_LIMIT: u64 = 1 << 24;

/// Most blocks `ccm_block_list_info()` and `ccm_unpack_block_list()` accept: 2^24, or
/// this node's shared_buffers if larger (a list made by `ccm_hot_blocks()` on a node holds
/// at most one block per buffer).
pub fn inspect_limit() -> u64 {
    INSPECT_MIN_LIMIT.max(buffers::buffer_count() as u64)
}

/// Validates the whole list in place (no allocation) or raises the ERROR.
fn validated(list: &[u8]) -> BlockListView<'_> {
    let limit = inspect_limit();
    BlockListView::parse_bounded(list, limit).unwrap_or_else(|error| {
        errors::block_list_refused(
            &error,
            &format!(
                "ccm_block_list_info() and ccm_unpack_block_list() accept lists of up to {limit} blocks \
                 (2^24, or shared_buffers if larger)."
            ),
        )
    })
}

/// One block as a row: pg_buffercache's column types, plus the usage count.
pub(crate) type BlockRow = (CatalogOid, CatalogOid, CatalogOid, i16, i64, i16);

pub(crate) fn block_row(block: HotBlock) -> BlockRow {
    (
        CatalogOid(block.addr.spc),
        CatalogOid(block.addr.db),
        CatalogOid(block.addr.rel),
        i16::from(block.addr.fork),
        i64::from(block.addr.block),
        i16::from(block.usage),
    )
}

/// Header and size of a block list made by ccm_hot_blocks(). The whole list is checked,
/// in place; nothing is allocated for its blocks.
#[pg_extern(immutable, parallel_safe)]
fn ccm_block_list_info(
    list: &[u8],
) -> TableIterator<
    'static,
    (
        name!(version, i32),
        name!(relation_forks, i64),
        name!(blocks, i64),
        name!(hot_buffers_found, i64),
        name!(buffers_scanned, i64),
        name!(bytes, i64),
    ),
> {
    let header: BlockListHeader = validated(list).header();
    TableIterator::once((
        i32::from(header.version),
        i64::from(header.groups),
        i64::from(header.blocks),
        i64::try_from(header.hot_buffers_found).unwrap_or(i64::MAX),
        i64::try_from(header.buffers_scanned).unwrap_or(i64::MAX),
        list.len() as i64,
    ))
}

/// The blocks of a list, one row each, in address order, streamed.
///
/// The iterator borrows `list`. On the first call pgrx unboxes the argument inside the
/// SRF's multi_call_memory_ctx, so a detoasted copy lives until the SRF is done (the
/// iterator is dropped by that context's reset callback, before its memory goes); an
/// argument that needed no detoasting is the caller's datum, which PostgreSQL keeps
/// valid across the calls of a value-per-call SRF (nodeProjectSet.c, execSRF.c; core's
/// array_unnest() relies on the same). The whole list is validated before the first row.
#[pg_extern(immutable, parallel_safe)]
fn ccm_unpack_block_list<'a>(
    list: &'a [u8],
) -> TableIterator<
    'a,
    (
        name!(reltablespace, CatalogOid),
        name!(reldatabase, CatalogOid),
        name!(relfilenode, CatalogOid),
        name!(relforknumber, i16),
        name!(relblocknumber, i64),
        name!(usagecount, i16),
    ),
> {
    TableIterator::new(validated(list).iter().map(block_row))
}
