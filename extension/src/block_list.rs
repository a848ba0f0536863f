//! Inspecting packed block lists from SQL.

use ccm_codec::{BlockList, HotBlock};
use pgrx::prelude::*;

use crate::catalog_oid::CatalogOid;
use crate::errors;

fn decode(list: &[u8]) -> BlockList {
    BlockList::decode(list).unwrap_or_else(|error| errors::invalid_input("block list", &error))
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

/// Header and size of a block list made by ccm_hot_blocks().
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
    let decoded = decode(list);
    let header = decoded.header;
    TableIterator::once((
        i32::from(header.version),
        i64::from(header.groups),
        i64::from(header.blocks),
        i64::try_from(header.hot_buffers_found).unwrap_or(i64::MAX),
        i64::try_from(header.buffers_scanned).unwrap_or(i64::MAX),
        list.len() as i64,
    ))
}

/// The blocks of a list, one row each, in address order.
#[pg_extern(immutable, parallel_safe)]
fn ccm_unpack_block_list(
    list: &[u8],
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
    let rows: Vec<BlockRow> = decode(list).iter().map(block_row).collect();
    TableIterator::new(rows)
}
