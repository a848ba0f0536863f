//! SQL functions of the buffer-address bloom filter.
//!
//! The standby summarizes what its shared_buffers hold in a bloom filter
//! (`ccm_buffer_filter`), so the primary sends only addresses the standby lacks. Every
//! filter gets a fresh random seed: a block hidden by a false positive in one cycle is
//! tested against different bits in the next, so no block stays hidden for long.

use ccm_codec::{BlockAddress, FilterBuilder, FilterView, MAX_BLOCK, MAX_FORK};
use pgrx::prelude::*;

use crate::buffers;
use crate::errors;

/// Parses a filter or raises the ERROR that says what is wrong with it.
pub fn parse_filter(bytes: &[u8]) -> FilterView<'_> {
    FilterView::parse(bytes).unwrap_or_else(|error| errors::invalid_input("filter", &error))
}

fn random_seed() -> u64 {
    let mut seed = [0u8; 8];
    if unsafe { pg_sys::pg_strong_random(seed.as_mut_ptr().cast(), seed.len()) } {
        return u64::from_le_bytes(seed);
    }
    // pg_strong_random() cannot fail on Linux builds; a time-based seed still varies.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos() as u64);
    nanos ^ u64::from(std::process::id()).rotate_left(32)
}

/// Addresses of every valid buffer in shared_buffers.
fn cached_addresses() -> Vec<BlockAddress> {
    let count = buffers::buffer_count();
    let mut addresses = Vec::with_capacity(count);
    for index in 0..count {
        if let Some(buffer) = buffers::read_header(index) {
            addresses.push(buffer.address);
        }
        if index % 65536 == 0 {
            pg_sys::check_for_interrupts!();
        }
    }
    addresses
}

/// Bloom filter of the buffer tags this node's shared_buffers hold.
#[pg_extern(volatile, parallel_safe)]
fn ccm_buffer_filter(false_positive_rate: default!(f64, 0.01)) -> Vec<u8> {
    errors::require_enabled();
    let addresses = cached_addresses();
    let mut filter = FilterBuilder::new(addresses.len() as u64, false_positive_rate, random_seed())
        .unwrap_or_else(|error| {
            errors::invalid_argument(
                format!("invalid false_positive_rate: {false_positive_rate}"),
                Some(format!("{error}.")),
            )
        });
    for address in &addresses {
        filter.insert(address);
    }
    filter.finish()
}

/// Builds the address a user typed, checking the ranges PostgreSQL allows.
pub fn address_from_sql(
    spcoid: pg_sys::Oid,
    dboid: pg_sys::Oid,
    relfilenode: pg_sys::Oid,
    forknum: i16,
    blocknum: i64,
) -> BlockAddress {
    if !(0..=i16::from(MAX_FORK)).contains(&forknum) {
        errors::invalid_argument(
            format!("invalid fork number: {forknum}"),
            Some(format!("Fork numbers range from 0 to {MAX_FORK}.")),
        );
    }
    if !(0..=i64::from(MAX_BLOCK)).contains(&blocknum) {
        errors::invalid_argument(
            format!("invalid block number: {blocknum}"),
            Some(format!("Block numbers range from 0 to {MAX_BLOCK}.")),
        );
    }
    BlockAddress {
        spc: spcoid.to_u32(),
        db: dboid.to_u32(),
        rel: relfilenode.to_u32(),
        fork: forknum as u8,
        block: blocknum as u32,
    }
}

/// Does the filter (probably) contain this block? False positives at the filter's rate,
/// never false negatives.
#[pg_extern(immutable, parallel_safe)]
fn ccm_filter_contains(
    filter: &[u8],
    spcoid: pg_sys::Oid,
    dboid: pg_sys::Oid,
    relfilenode: pg_sys::Oid,
    forknum: i16,
    blocknum: i64,
) -> bool {
    let view = parse_filter(filter);
    view.contains(&address_from_sql(spcoid, dboid, relfilenode, forknum, blocknum))
}

/// Shape of a filter: size, hash count, items, and the false-positive rate its fill implies.
#[pg_extern(immutable, parallel_safe)]
fn ccm_filter_info(
    filter: &[u8],
) -> TableIterator<
    'static,
    (
        name!(bits, i64),
        name!(hashes, i32),
        name!(items, i64),
        name!(false_positive_rate, f64),
        name!(bytes, i64),
    ),
> {
    let view = parse_filter(filter);
    TableIterator::once((
        view.bit_count() as i64,
        i32::from(view.hash_count()),
        view.item_count().min(i64::MAX as u64) as i64,
        view.estimated_false_positive_rate(),
        filter.len() as i64,
    ))
}
