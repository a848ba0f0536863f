//! SQL functions of the buffer-address bloom filter.
//!
//! The standby summarizes what its shared_buffers hold in a bloom filter
//! (`ccm_buffer_filter`), so the primary sends only addresses the standby lacks. Every
//! filter gets a fresh random seed: a block hidden by a false positive in one cycle is
//! tested against different bits in the next, so no block stays hidden for long.
//!
//! Memory: a filter passed in (`ccm_filter_contains`, `ccm_filter_info`, and
//! `ccm_hot_blocks` through [`parse_filter`]) is read in place, with no copy and no
//! allocation. Building one (`ccm_buffer_filter`, granted to `ccm_agent`) costs the
//! addresses of the cached buffers (20 bytes per buffer) plus the filter, twice (the
//! builder's buffer and the returned bytea); the rate must be at least 1e-6, so the
//! filter is at most about 29 bits per cached buffer. Every Rust allocation is made with
//! `try_reserve`: failure raises 53200 "out of memory", never a Rust abort.
//! A rate out of range raises 22023 invalid_parameter_value.

use ccm_codec::{
    format_rate, BlockAddress, FilterBuilder, FilterParamError, FilterView, FILTER_MIN_FALSE_POSITIVE_RATE,
    MAX_BLOCK, MAX_FORK,
};
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;

use crate::buffers;
use crate::errors;

/// Parses a filter (zero-copy: the view borrows the detoasted argument) or raises the
/// ERROR that says what is wrong with it.
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

/// Raises 53200 "out of memory" for a Rust allocation of `bytes` that failed.
/// Addresses of every valid buffer in shared_buffers.
fn cached_addresses() -> Vec<BlockAddress> {
    let count = buffers::buffer_count();
    let mut addresses = Vec::new();
    if addresses.try_reserve_exact(count).is_err() {
        let bytes = (count as u64).saturating_mul(std::mem::size_of::<BlockAddress>() as u64);
        errors::out_of_memory("the addresses of the cached buffers", bytes);
    }
    for index in 0..count {
        if let Some(buffer) = buffers::read_header(index) {
            addresses.push(buffer.address); // within the reserved capacity
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
    // Check the rate before scanning or allocating anything.
    if !(FILTER_MIN_FALSE_POSITIVE_RATE..1.0).contains(&false_positive_rate) {
        invalid_rate(false_positive_rate, &FilterParamError::FalsePositiveRate(false_positive_rate));
    }
    let addresses = cached_addresses();
    let mut filter = FilterBuilder::new(addresses.len() as u64, false_positive_rate, random_seed())
        .unwrap_or_else(|error| match error {
            FilterParamError::OutOfMemory { bytes } => errors::out_of_memory("a pg_ccm filter", bytes),
            FilterParamError::FalsePositiveRate(_) => invalid_rate(false_positive_rate, &error),
        });
    for address in &addresses {
        filter.insert(address);
    }
    filter.finish()
}

/// Raises 22023 for a false-positive rate outside [1e-6, 1), with the codec's reason as
/// DETAIL.
fn invalid_rate(rate: f64, error: &FilterParamError) -> ! {
    let detail = error.to_string();
    let mut chars = detail.chars();
    let detail = chars.next().map_or_else(String::new, |first| format!("{}{}.", first.to_uppercase(), chars.as_str()));
    errors::raise(
        PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
        format!("invalid false_positive_rate: {}", format_rate(rate)),
        Some(detail),
        Some(
            "The default, 0.01, costs about 10 bits per cached buffer; each tenfold lower rate costs about 5 more. \
             A false positive only delays a block by one cycle.",
        ),
    )
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
