//! Memory bounds of the decoders, measured: this test binary counts (and can refuse) the
//! heap allocations of the thread that runs each test.
//!
//! - a header over the caller's limit is refused before anything is allocated;
//! - validating and streaming a list allocate nothing, whatever its size;
//! - decoding allocates about 5 bytes per block, and an allocation failure is an error
//!   value (`OutOfMemory`), not an abort; the same for the filter builder;
//! - encoding is fallible the same way, and allocates its output once, at its exact length;
//! - a false-positive rate below the floor is refused before the filter is allocated.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use ccm_codec::{
    encode_block_list, BlockList, BlockListView, DecodeError, DecodeErrorKind, EncodeError, FilterBuilder,
    FilterParamError,
    HotBlock, RelFork, FILTER_MIN_FALSE_POSITIVE_RATE,
};

struct Counting;

thread_local! {
    /// Bytes this thread has allocated (reallocations count their new size).
    static ALLOCATED: Cell<u64> = const { Cell::new(0) };
    /// Requests larger than this fail, as malloc does under an address-space limit.
    static FAIL_ABOVE: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn admit(size: usize) -> bool {
    if size > FAIL_ABOVE.try_with(Cell::get).unwrap_or(usize::MAX) {
        return false;
    }
    let _ = ALLOCATED.try_with(|total| total.set(total.get() + size as u64));
    true
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !admit(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !admit(new_size) {
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns its result with the bytes this thread allocated meanwhile.
fn measured<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = ALLOCATED.with(Cell::get);
    let result = f();
    (result, ALLOCATED.with(Cell::get) - before)
}

/// Runs `f` with every allocation larger than `limit` bytes failing.
fn with_allocations_up_to<T>(limit: usize, f: impl FnOnce() -> T) -> T {
    FAIL_ABOVE.with(|cell| cell.set(limit));
    let result = f();
    FAIL_ABOVE.with(|cell| cell.set(usize::MAX));
    result
}

const REL: RelFork = RelFork { spc: 1663, db: 5, rel: 16384, fork: 0 };

/// One relation fork, one run of `blocks` blocks from block 0, every usage count `usage`:
/// the densest valid list (half a byte per block). With usage 0 and 100 million blocks
/// this is the 50 MB list of the safety review's finding 2.
fn one_run(blocks: u32, usage: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(48 + blocks as usize / 2);
    out.extend_from_slice(b"CCMB");
    out.extend_from_slice(&[1, 0, 0, 0]);
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&blocks.to_le_bytes());
    out.extend_from_slice(&[0; 16]);
    out.extend_from_slice(&REL.spc.to_le_bytes());
    out.extend_from_slice(&REL.db.to_le_bytes());
    out.extend_from_slice(&REL.rel.to_le_bytes());
    out.push(REL.fork);
    out.push(1); // one run
    out.push(0); // starting at block 0
    let mut length = blocks - 1; // varint of length - 1
    while length >= 0x80 {
        out.push((length as u8) | 0x80);
        length >>= 7;
    }
    out.push(length as u8);
    out.resize(out.len() + (blocks as usize).div_ceil(2), usage | (usage << 4));
    if blocks % 2 == 1 {
        *out.last_mut().unwrap() = usage;
    }
    out
}

/// A list with many relation forks and scattered runs.
fn scattered(forks: u32, per_fork: u32) -> Vec<u8> {
    let mut blocks: Vec<HotBlock> = (0..forks)
        .flat_map(|f| (0..per_fork).map(move |b| HotBlock { addr: RelFork { rel: 16384 + f, ..REL }.block(b * 3 + b % 2), usage: (b % 6) as u8 }))
        .collect();
    encode_block_list(&mut blocks, 1, 2).unwrap()
}

#[test]
fn the_reviews_hostile_list_is_refused_before_anything_is_allocated() {
    let hostile = one_run(100_000_000, 0);
    assert_eq!(hostile.len(), 32 + 13 + 1 + 1 + 4 + 50_000_000);
    let started = Instant::now();
    let (decoded, allocated) = measured(|| BlockList::decode_bounded(&hostile, 1_000_000));
    let error = decoded.unwrap_err();
    assert_eq!(error, DecodeError::TooManyBlocks { declared: 100_000_000, limit: 1_000_000 });
    assert_eq!(error.kind(), DecodeErrorKind::TooLarge);
    assert_eq!(error.to_string(), "header declares 100000000 blocks but at most 1000000 are accepted here");
    assert_eq!(allocated, 0, "decode_bounded allocated before refusing the header");
    let (viewed, allocated) = measured(|| BlockListView::parse_bounded(&hostile, 1_000_000).map(|view| view.len()));
    assert_eq!(viewed.unwrap_err(), error);
    assert_eq!(allocated, 0);
    // Both stop at the header: constant time, whatever follows it.
    assert!(started.elapsed().as_millis() < 50, "took {:?}", started.elapsed());
}

#[test]
fn the_limit_is_inclusive() {
    let list = one_run(1000, 5);
    assert_eq!(BlockList::decode_bounded(&list, 1000).unwrap().len(), 1000);
    assert_eq!(BlockListView::parse_bounded(&list, 1000).unwrap().len(), 1000);
    assert!(matches!(BlockList::decode_bounded(&list, 999), Err(DecodeError::TooManyBlocks { declared: 1000, limit: 999 })));
    assert!(matches!(BlockListView::parse_bounded(&list, 999), Err(DecodeError::TooManyBlocks { declared: 1000, limit: 999 })));
    // An empty list fits any limit.
    let empty = encode_block_list(&mut Vec::new(), 0, 0).unwrap();
    assert!(BlockList::decode_bounded(&empty, 0).unwrap().is_empty());
    assert!(BlockListView::parse_bounded(&empty, 0).unwrap().iter().next().is_none());
}

#[test]
fn structural_errors_come_before_the_limit() {
    // A header that declares more blocks than its bytes can hold is corrupt, whatever the
    // caller's limit.
    let mut short = one_run(1000, 5);
    short.truncate(100);
    let error = BlockList::decode_bounded(&short, 10).unwrap_err();
    assert!(matches!(error, DecodeError::TooMany { what: "blocks", .. }), "{error:?}");
    assert_eq!(error.kind(), DecodeErrorKind::Corrupt);
}

#[test]
fn validating_and_streaming_allocate_nothing() {
    for list in [one_run(10_000_000, 3), scattered(500, 2000)] {
        let ((blocks, usage_sum), allocated) = measured(|| {
            let view = BlockListView::parse(&list).unwrap();
            let mut count = 0u64;
            let mut usage_sum = 0u64;
            for block in view.iter() {
                count += 1;
                usage_sum += u64::from(block.usage);
            }
            (count, usage_sum)
        });
        assert_eq!(allocated, 0, "validation or streaming allocated {allocated} bytes");
        let expected = BlockList::decode(&list).unwrap();
        assert_eq!(blocks, expected.len() as u64);
        assert_eq!(usage_sum, expected.iter().map(|b| u64::from(b.usage)).sum::<u64>());
    }
}

#[test]
fn decoding_costs_about_five_bytes_per_block_and_200_per_fork() {
    for (list, forks) in [(one_run(1_000_000, 4), 1u64), (scattered(1000, 1000), 1000)] {
        let (decoded, allocated) = measured(|| BlockList::decode_bounded(&list, u64::MAX).unwrap());
        let blocks = decoded.len() as u64;
        let bound = 5 * blocks + 200 * forks + 256; // the fork vector starts at 4 entries
        assert!(allocated <= bound, "{allocated} bytes for {blocks} blocks in {forks} forks (bound {bound})");
    }
}

#[test]
fn a_failed_allocation_is_an_error_not_an_abort() {
    let list = one_run(1_000_000, 5);
    // 4 MB of block numbers cannot be had.
    let error = with_allocations_up_to(1 << 20, || BlockList::decode_bounded(&list, u64::MAX)).unwrap_err();
    assert_eq!(error, DecodeError::OutOfMemory { bytes: 4_000_000 });
    assert_eq!(error.kind(), DecodeErrorKind::OutOfMemory);
    assert_eq!(error.to_string(), "could not allocate 4000000 bytes");
    // With room, the same list decodes.
    assert_eq!(BlockList::decode_bounded(&list, u64::MAX).unwrap().len(), 1_000_000);

    // 1% for ten million items is about 12 MB of bits.
    let error = with_allocations_up_to(1 << 20, || FilterBuilder::new(10_000_000, 0.01, 1)).unwrap_err();
    assert!(matches!(error, FilterParamError::OutOfMemory { bytes } if bytes > 11_000_000), "{error:?}");
    assert!(error.to_string().starts_with("could not allocate "), "{error}");
}

/// `count` blocks of one relation fork, every third one, usage cycling 0..=5.
fn spread(count: u32) -> Vec<HotBlock> {
    (0..count).map(|b| HotBlock { addr: REL.block(b * 3), usage: (b % 6) as u8 }).collect()
}

#[test]
fn a_failed_allocation_while_encoding_is_an_error_not_an_abort() {
    // The encoder's own copy of a million block numbers (4 MB) cannot be had.
    let mut blocks = spread(1_000_000);
    let error = with_allocations_up_to(1 << 20, || encode_block_list(&mut blocks, 0, 0)).unwrap_err();
    assert!(matches!(error, EncodeError::OutOfMemory { bytes } if bytes > 1 << 20), "{error:?}");
    assert!(error.to_string().starts_with("could not allocate "), "{error}");
    // With room, the same blocks encode.
    assert_eq!(BlockList::decode(&encode_block_list(&mut blocks, 0, 0).unwrap()).unwrap().len(), 1_000_000);

    // Nor its output: 1023 blocks 2^22 apart take 5.5 bytes each encoded (a 4-byte gap, a
    // 1-byte length, a usage nibble), more than the encoder's 4-byte copy of each (4 kB).
    let mut far: Vec<HotBlock> = (0..1023).map(|b| HotBlock { addr: REL.block(b << 22), usage: 1 }).collect();
    let list = encode_block_list(&mut far, 0, 0).unwrap();
    assert!(list.len() > 5_000, "{} bytes", list.len());
    let error = with_allocations_up_to(5_000, || encode_block_list(&mut far, 0, 0).map(|list| list.len())).unwrap_err();
    assert_eq!(error, EncodeError::OutOfMemory { bytes: list.len() as u64 });
}

#[test]
fn encoding_allocates_its_output_once_at_its_exact_length() {
    let scattered: Vec<HotBlock> = BlockList::decode(&scattered(300, 700)).unwrap().iter().collect();
    for (mut blocks, forks) in [(spread(100_000), 1u64), (scattered, 300)] {
        let count = blocks.len() as u64;
        let (list, allocated) = measured(|| encode_block_list(&mut blocks, 0, 0).unwrap());
        assert_eq!(list.capacity(), list.len(), "the output was reserved at its exact length");
        // The encoder's copy (5 bytes a block; this counter adds up every reallocation's new
        // size, so doubling growth counts up to 4 times the final length) and the output.
        let bound = 20 * count + 400 * forks + list.len() as u64 + 256;
        assert!(allocated <= bound, "{allocated} bytes for {count} blocks in {forks} forks (bound {bound})");
    }
}

#[test]
fn a_rate_below_the_floor_is_refused_before_allocating() {
    for rate in [1e-300, 1e-7, f64::MIN_POSITIVE] {
        let (built, allocated) = measured(|| FilterBuilder::new(1 << 30, rate, 0).map(|b| b.bit_count()));
        assert_eq!(built, Err(FilterParamError::FalsePositiveRate(rate)));
        assert_eq!(allocated, 0);
    }
    assert_eq!(
        FilterParamError::FalsePositiveRate(1e-300).to_string(),
        "the false-positive rate must be at least 1e-6 and less than 1, got 1e-300"
    );
    // The floor itself is accepted and costs under 29 bits per item.
    let items = 100_000u64;
    let (builder, allocated) = measured(|| FilterBuilder::new(items, FILTER_MIN_FALSE_POSITIVE_RATE, 0).unwrap());
    assert!(builder.bit_count() <= 29 * items, "{} bits", builder.bit_count());
    // One allocation: header and bits, handed over by finish() without a copy.
    assert_eq!(allocated, 32 + builder.bit_count() / 8);
    let bits = builder.bit_count();
    let (bytes, allocated) = measured(|| builder.finish());
    assert_eq!(allocated, 0);
    assert_eq!(bytes.len() as u64, 32 + bits / 8);
}
