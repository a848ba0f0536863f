//! Packed list of hot blocks with their usage counts, sorted by address.
//!
//! Format v1, little endian. Header (32 bytes):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `CCMB` |
//! | 4 | version (1) |
//! | 5 | flags, 0 |
//! | 6..8 | reserved, 0 |
//! | 8..12 | relation-fork (group) count G |
//! | 12..16 | block count N |
//! | 16..24 | hot buffers the primary's scan found (informational) |
//! | 24..32 | buffers the scan visited (informational) |
//!
//! Then G groups in strictly increasing (spc, db, rel, fork) order, each: spc, db, rel
//! (u32), fork (u8, ≤ 3), run count R (varint, ≥ 1), R runs of (gap, length − 1) varints,
//! then one 4-bit usage count per block, low nibble first, a zero high nibble padding an
//! odd count. Run 0 starts at block `gap`; run i > 0 at previous end + 1 + gap with
//! gap ≥ 1, so runs never touch and blocks are strictly increasing. The encoding of a
//! given list is unique, and decoding checks all of it. A clustered hot set costs about
//! half a byte per block (its usage nibble).
//!
//! Reading a list, from cheapest to dearest (none panics on any input; the last two run
//! the same checks in the same order, so they refuse the same inputs with the same errors):
//!
//! - [`decode_block_list_header`]: the header alone, and that the input is long enough
//!   for the counts it declares (at most two blocks per byte).
//! - [`BlockListView::parse_bounded`]: the whole list, in place, allocating nothing; then
//!   [`BlockListView::iter`] streams its blocks. For consumers that need each block once
//!   (row by row output), whatever the list's size.
//! - [`BlockList::decode_bounded`]: materialises the blocks (about 5 bytes each). The
//!   caller's `max_blocks` is checked against the header before anything is allocated,
//!   and allocation uses `try_reserve`, so a hostile header yields `TooManyBlocks` or
//!   `OutOfMemory`, never an abort. [`BlockList::decode`] has no limit but the input's
//!   length: for trusted input (the agent).

use crate::address::{BlockAddress, HotBlock, RelFork, MAX_BLOCK, MAX_FORK, MAX_USAGE};
use crate::error::{DecodeError, EncodeError};
use crate::varint;

pub const BLOCK_LIST_MAGIC: [u8; 4] = *b"CCMB";
pub const BLOCK_LIST_VERSION: u8 = 1;
pub const BLOCK_LIST_HEADER_LEN: usize = 32;
/// spc, db, rel, fork, one run count byte, one run of two bytes.
const MIN_GROUP_LEN: usize = 4 + 4 + 4 + 1 + 1 + 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BlockListHeader {
    pub version: u8,
    pub groups: u32,
    pub blocks: u32,
    pub hot_buffers_found: u64,
    pub buffers_scanned: u64,
}

/// The blocks of one relation fork.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockGroup {
    pub rel: RelFork,
    /// Strictly increasing.
    pub blocks: Vec<u32>,
    /// One per block.
    pub usage: Vec<u8>,
}

/// A decoded list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockList {
    pub header: BlockListHeader,
    pub groups: Vec<BlockGroup>,
}

/// Builds a list from blocks pushed in strictly increasing address order.
#[derive(Clone, Debug, Default)]
pub struct BlockListEncoder {
    groups: Vec<BlockGroup>,
    count: usize,
    last: Option<BlockAddress>,
}

impl BlockListEncoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, block: HotBlock) -> Result<(), EncodeError> {
        let addr = block.addr;
        if block.usage > MAX_USAGE {
            return Err(EncodeError::Usage(block.usage));
        }
        if addr.fork > MAX_FORK {
            return Err(EncodeError::Fork(addr.fork));
        }
        if addr.block > MAX_BLOCK {
            return Err(EncodeError::Block(addr.block));
        }
        if let Some(previous) = self.last {
            if addr <= previous {
                return Err(EncodeError::Unsorted { previous, next: addr });
            }
        }
        if self.count == u32::MAX as usize {
            return Err(EncodeError::TooManyBlocks);
        }
        let rel = addr.rel_fork();
        if self.groups.last().is_none_or(|group| group.rel != rel) {
            try_grow(&mut self.groups)?;
            self.groups.push(BlockGroup { rel, blocks: Vec::new(), usage: Vec::new() }); // within capacity
        }
        let group = self.groups.last_mut().expect("a group was pushed above");
        try_grow(&mut group.blocks)?;
        try_grow(&mut group.usage)?;
        group.blocks.push(addr.block); // within capacity
        group.usage.push(block.usage);
        self.count += 1;
        self.last = Some(addr);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The encoded list. Its exact length is computed first and reserved with
    /// `try_reserve_exact`, so that a failed allocation is [`EncodeError::OutOfMemory`].
    pub fn finish(self, hot_buffers_found: u64, buffers_scanned: u64) -> Result<Vec<u8>, EncodeError> {
        let header = BlockListHeader {
            version: BLOCK_LIST_VERSION,
            groups: self.groups.len() as u32,
            blocks: self.count as u32,
            hot_buffers_found,
            buffers_scanned,
        };
        encode_groups(&header, &self.groups)
    }
}

fn write_header(out: &mut Vec<u8>, header: &BlockListHeader) {
    out.extend_from_slice(&BLOCK_LIST_MAGIC);
    out.push(BLOCK_LIST_VERSION);
    out.push(0);
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&header.groups.to_le_bytes());
    out.extend_from_slice(&header.blocks.to_le_bytes());
    out.extend_from_slice(&header.hot_buffers_found.to_le_bytes());
    out.extend_from_slice(&header.buffers_scanned.to_le_bytes());
}

/// Room for one more item in `items`, reserved with `try_reserve` (amortised doubling, as a
/// push would), or `OutOfMemory`.
fn try_grow<T>(items: &mut Vec<T>) -> Result<(), EncodeError> {
    if items.len() < items.capacity() {
        return Ok(());
    }
    items.try_reserve(1).map_err(|_| EncodeError::OutOfMemory {
        bytes: (items.capacity() as u64 * 2).max(4) * std::mem::size_of::<T>() as u64,
    })
}

/// (gap, length − 1) of each maximal run of consecutive blocks, as the format stores them:
/// computed on the fly, so that encoding allocates nothing but its output.
fn runs(blocks: &[u32]) -> impl Iterator<Item = (u32, u32)> + '_ {
    let mut rest = blocks;
    let mut previous_end: Option<u32> = None;
    std::iter::from_fn(move || {
        let (&start, _) = rest.split_first()?;
        let length = rest.iter().zip(start..).take_while(|(&block, expected)| block == *expected).count();
        rest = &rest[length..];
        let end = start + (length as u32 - 1);
        let gap = previous_end.map_or(start, |previous| start - previous - 1);
        previous_end = Some(end);
        Some((gap, length as u32 - 1))
    })
}

/// The exact length of the encoding of `groups`.
fn encoded_len(groups: &[BlockGroup]) -> u64 {
    let mut len = BLOCK_LIST_HEADER_LEN as u64;
    for group in groups {
        let mut count = 0u32;
        let mut body = 0u64;
        for (gap, length) in runs(&group.blocks) {
            count += 1;
            body += (varint::len(gap) + varint::len(length)) as u64;
        }
        len += 13 + varint::len(count) as u64 + body + (group.usage.len() as u64).div_ceil(2);
    }
    len
}

fn encode_groups(header: &BlockListHeader, groups: &[BlockGroup]) -> Result<Vec<u8>, EncodeError> {
    let len = encoded_len(groups);
    let mut out: Vec<u8> = Vec::new();
    usize::try_from(len).ok().and_then(|len| out.try_reserve_exact(len).ok()).ok_or(EncodeError::OutOfMemory { bytes: len })?;
    // Every write below is within that capacity.
    write_header(&mut out, header);
    for group in groups {
        out.extend_from_slice(&group.rel.spc.to_le_bytes());
        out.extend_from_slice(&group.rel.db.to_le_bytes());
        out.extend_from_slice(&group.rel.rel.to_le_bytes());
        out.push(group.rel.fork);
        varint::write(&mut out, runs(&group.blocks).count() as u32);
        for (gap, length) in runs(&group.blocks) {
            varint::write(&mut out, gap);
            varint::write(&mut out, length);
        }
        for pair in group.usage.chunks(2) {
            out.push(pair[0] | pair.get(1).map_or(0, |high| high << 4));
        }
    }
    debug_assert_eq!(out.len() as u64, len, "encoded_len() agrees with the encoding");
    Ok(out)
}

/// Sorts by address (keeping the higher usage of duplicates) and encodes. Allocations use
/// `try_reserve`: a failed one is [`EncodeError::OutOfMemory`], never an abort.
pub fn encode_block_list(blocks: &mut Vec<HotBlock>, hot_buffers_found: u64, buffers_scanned: u64) -> Result<Vec<u8>, EncodeError> {
    blocks.sort_unstable_by(|a, b| a.addr.cmp(&b.addr).then(b.usage.cmp(&a.usage)));
    blocks.dedup_by_key(|block| block.addr);
    let mut encoder = BlockListEncoder::new();
    for block in blocks.iter() {
        encoder.push(*block)?;
    }
    encoder.finish(hot_buffers_found, buffers_scanned)
}

fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes(bytes[offset..offset + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(bytes[offset..offset + 8].try_into().expect("8 bytes"))
}

/// Validates and returns the header alone (cheap: does not read the groups). The counts it
/// returns are bounded by the input's length: at most one relation fork per 16 bytes and
/// two blocks per byte.
pub fn decode_block_list_header(bytes: &[u8]) -> Result<BlockListHeader, DecodeError> {
    if bytes.len() >= 4 && bytes[0..4] != BLOCK_LIST_MAGIC {
        return Err(DecodeError::BadMagic { expected: "block list" });
    }
    if bytes.len() < BLOCK_LIST_HEADER_LEN {
        return Err(DecodeError::ShortHeader { len: bytes.len(), needed: BLOCK_LIST_HEADER_LEN });
    }
    if bytes[4] != BLOCK_LIST_VERSION {
        return Err(DecodeError::UnsupportedVersion { found: bytes[4], supported: BLOCK_LIST_VERSION });
    }
    if bytes[5] != 0 {
        return Err(DecodeError::Reserved { field: "block list flags", value: u64::from(bytes[5]) });
    }
    let reserved = u16::from_le_bytes([bytes[6], bytes[7]]);
    if reserved != 0 {
        return Err(DecodeError::Reserved { field: "block list reserved bytes", value: u64::from(reserved) });
    }
    let header = BlockListHeader {
        version: bytes[4],
        groups: u32_at(bytes, 8),
        blocks: u32_at(bytes, 12),
        hot_buffers_found: u64_at(bytes, 16),
        buffers_scanned: u64_at(bytes, 24),
    };
    // Bound what the body can hold before anything is allocated from these counts.
    let body = bytes.len() - BLOCK_LIST_HEADER_LEN;
    let possible_groups = (body / MIN_GROUP_LEN) as u64;
    if u64::from(header.groups) > possible_groups {
        return Err(DecodeError::TooMany { what: "relation forks", declared: header.groups.into(), possible: possible_groups, len: bytes.len() });
    }
    let possible_blocks = body as u64 * 2;
    if u64::from(header.blocks) > possible_blocks {
        return Err(DecodeError::TooMany { what: "blocks", declared: header.blocks.into(), possible: possible_blocks, len: bytes.len() });
    }
    if header.groups == 0 && header.blocks != 0 {
        return Err(DecodeError::BlockCount { declared: header.blocks, found: 0 });
    }
    Ok(header)
}

/// Rejects a list that declares more blocks than the caller accepts.
fn check_limit(header: &BlockListHeader, max_blocks: u64) -> Result<(), DecodeError> {
    if u64::from(header.blocks) > max_blocks {
        return Err(DecodeError::TooManyBlocks { declared: header.blocks.into(), limit: max_blocks });
    }
    Ok(())
}

/// An empty vector with room for exactly `len` items, or `OutOfMemory`.
fn try_vec<T>(len: u64) -> Result<Vec<T>, DecodeError> {
    let out_of_memory = || DecodeError::OutOfMemory { bytes: len.saturating_mul(std::mem::size_of::<T>() as u64) };
    let len = usize::try_from(len).map_err(|_| out_of_memory())?;
    let mut vec = Vec::new();
    vec.try_reserve_exact(len).map_err(|_| out_of_memory())?;
    Ok(vec)
}

/// One relation fork of a list, read in place: its runs have been checked (order, range,
/// count against the header), its usage nibbles are where they should be.
#[derive(Clone, Copy, Debug)]
pub struct GroupView<'a> {
    rel: RelFork,
    run_count: u32,
    /// The run varints.
    runs: &'a [u8],
    /// One nibble per block, low nibble first.
    usage: &'a [u8],
    len: u64,
}

impl<'a> GroupView<'a> {
    pub fn rel(&self) -> RelFork {
        self.rel
    }

    /// Blocks in this relation fork (at least one in a valid list).
    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runs of consecutive blocks, as (first, last) inclusive, in order.
    pub fn runs(&self) -> Runs<'a> {
        Runs { bytes: self.runs, offset: 0, left: self.run_count, next_start: 0 }
    }

    /// The blocks with their usage counts, in order.
    pub fn iter(&self) -> GroupBlocks<'a> {
        GroupBlocks { rel: self.rel, runs: self.runs(), next: 1, last: 0, usage: self.usage, nibble: 0, left: self.len }
    }

    /// The block number of the `n`th block (for error messages).
    fn nth_block(&self, mut n: u64) -> u32 {
        for (first, last) in self.runs() {
            let span = u64::from(last - first) + 1;
            if n < span {
                return first + n as u32;
            }
            n -= span;
        }
        0
    }

    /// Every usage count is at most MAX_USAGE and the padding nibble of an odd count is 0.
    fn check_usage(&self, index: u32) -> Result<(), DecodeError> {
        for (i, &byte) in self.usage.iter().enumerate() {
            let low_nibble = 2 * i as u64;
            for (nibble, value) in [(low_nibble, byte & 0x0F), (low_nibble + 1, byte >> 4)] {
                if nibble < self.len && value > MAX_USAGE {
                    return Err(DecodeError::Usage { index, block: self.nth_block(nibble), value });
                }
            }
        }
        if self.len % 2 == 1 && self.usage.last().is_some_and(|&last| last >> 4 != 0) {
            return Err(DecodeError::Padding { index });
        }
        Ok(())
    }
}

impl<'a> IntoIterator for GroupView<'a> {
    type Item = HotBlock;
    type IntoIter = GroupBlocks<'a>;

    fn into_iter(self) -> GroupBlocks<'a> {
        self.iter()
    }
}

/// Reads relation fork `index` at `*offset` and checks everything but its usage counts
/// (`GroupView::check_usage`) and its order after the previous fork. `found` blocks came
/// before it; the header declares `declared`. Allocates nothing.
fn scan_group<'a>(bytes: &'a [u8], offset: &mut usize, index: u32, declared: u32, found: u64) -> Result<GroupView<'a>, DecodeError> {
    let remaining_blocks = u64::from(declared).saturating_sub(found);
    if bytes.len().saturating_sub(*offset) < 13 {
        return Err(DecodeError::Truncated { len: bytes.len(), field: "a relation fork header" });
    }
    let rel = RelFork {
        spc: u32_at(bytes, *offset),
        db: u32_at(bytes, *offset + 4),
        rel: u32_at(bytes, *offset + 8),
        fork: bytes[*offset + 12],
    };
    *offset += 13;
    if rel.fork > MAX_FORK {
        return Err(DecodeError::Fork(rel.fork));
    }
    let run_count = varint::read(bytes, offset, "a run count")?;
    if run_count == 0 {
        return Err(DecodeError::NoRuns { index });
    }
    let runs_start = *offset;
    let mut len: u64 = 0;
    let mut next_start: u64 = 0; // first block the next run may start at
    for run in 0..run_count {
        let gap = varint::read(bytes, offset, "a run")?;
        let length = u64::from(varint::read(bytes, offset, "a run")?) + 1;
        if run > 0 && gap == 0 {
            return Err(DecodeError::RunOrder { index, run });
        }
        let start = next_start + u64::from(gap);
        let end = start + length - 1;
        if end > u64::from(MAX_BLOCK) {
            return Err(DecodeError::BlockRange { index, run });
        }
        if len + length > remaining_blocks {
            return Err(DecodeError::BlockCount { declared, found: found + len + length });
        }
        len += length;
        next_start = end + 1;
    }
    let runs = &bytes[runs_start..*offset];
    // len <= declared <= u32::MAX, so this fits a usize.
    let usage_len = len.div_ceil(2) as usize;
    let Some(usage) = offset.checked_add(usage_len).and_then(|end| bytes.get(*offset..end)) else {
        return Err(DecodeError::Truncated { len: bytes.len(), field: "usage counts" });
    };
    *offset += usage_len;
    Ok(GroupView { rel, run_count, runs, usage, len })
}

/// Checks a whole list, handing each checked relation fork to `each` in order; the one
/// parser behind [`BlockListView::parse_bounded`] and [`BlockList::decode_bounded`], so
/// both refuse exactly the same inputs with the same errors. Allocates nothing itself.
fn walk<'a>(
    bytes: &'a [u8],
    max_blocks: u64,
    mut each: impl FnMut(GroupView<'a>) -> Result<(), DecodeError>,
) -> Result<BlockListHeader, DecodeError> {
    let header = decode_block_list_header(bytes)?;
    check_limit(&header, max_blocks)?;
    let mut offset = BLOCK_LIST_HEADER_LEN;
    let mut found: u64 = 0;
    let mut previous: Option<RelFork> = None;
    for index in 0..header.groups {
        let group = scan_group(bytes, &mut offset, index, header.blocks, found)?;
        group.check_usage(index)?;
        if previous.is_some_and(|previous| previous >= group.rel) {
            return Err(DecodeError::GroupOrder { index });
        }
        found += group.len;
        previous = Some(group.rel);
        each(group)?;
    }
    if found != u64::from(header.blocks) {
        return Err(DecodeError::BlockCount { declared: header.blocks, found });
    }
    if offset != bytes.len() {
        return Err(DecodeError::TrailingBytes(bytes.len() - offset));
    }
    Ok(header)
}

/// A list checked in full and read in place: the streaming, allocation-free way to walk a
/// list of any size. Parsing validates every field (the same checks and errors as
/// [`BlockList::decode`]) before the first block can be read, so a consumer never sees
/// part of a malformed list. Iterating decodes the varints again, on the fly.
#[derive(Clone, Copy, Debug)]
pub struct BlockListView<'a> {
    header: BlockListHeader,
    bytes: &'a [u8],
}

impl<'a> BlockListView<'a> {
    /// Validates every field, allocating nothing.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        Self::parse_bounded(bytes, u64::MAX)
    }

    /// Like [`parse`](Self::parse), and refuses a header that declares more than
    /// `max_blocks` blocks ([`DecodeError::TooManyBlocks`]) before reading any group.
    pub fn parse_bounded(bytes: &'a [u8], max_blocks: u64) -> Result<Self, DecodeError> {
        let header = walk(bytes, max_blocks, |_| Ok(()))?;
        Ok(BlockListView { header, bytes })
    }

    pub fn header(&self) -> BlockListHeader {
        self.header
    }

    pub fn len(&self) -> usize {
        self.header.blocks as usize
    }

    pub fn is_empty(&self) -> bool {
        self.header.blocks == 0
    }

    /// The encoded list.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The relation forks, in order.
    pub fn groups(&self) -> Groups<'a> {
        Groups { bytes: self.bytes, offset: BLOCK_LIST_HEADER_LEN, index: 0, header: self.header, found: 0 }
    }

    /// Every block in address order, with its usage count; exact size.
    pub fn iter(&self) -> Blocks<'a> {
        Blocks { groups: self.groups(), current: None, left: u64::from(self.header.blocks) }
    }
}

impl<'a> IntoIterator for BlockListView<'a> {
    type Item = HotBlock;
    type IntoIter = Blocks<'a>;

    fn into_iter(self) -> Blocks<'a> {
        self.iter()
    }
}

/// The relation forks of a [`BlockListView`].
#[derive(Clone, Debug)]
pub struct Groups<'a> {
    bytes: &'a [u8],
    offset: usize,
    index: u32,
    header: BlockListHeader,
    found: u64,
}

impl<'a> Iterator for Groups<'a> {
    type Item = GroupView<'a>;

    fn next(&mut self) -> Option<GroupView<'a>> {
        if self.index >= self.header.groups {
            return None;
        }
        // The view checked these bytes: this cannot fail. If it somehow did, stop rather
        // than panic.
        let group = scan_group(self.bytes, &mut self.offset, self.index, self.header.blocks, self.found);
        debug_assert!(group.is_ok(), "a validated list failed to scan: {group:?}");
        let group = group.ok()?;
        self.index += 1;
        self.found += group.len;
        Some(group)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.header.groups - self.index) as usize;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Groups<'_> {}

/// The runs of a [`GroupView`]: (first, last) block numbers, inclusive.
#[derive(Clone, Debug)]
pub struct Runs<'a> {
    bytes: &'a [u8],
    offset: usize,
    left: u32,
    next_start: u64,
}

impl Iterator for Runs<'_> {
    type Item = (u32, u32);

    fn next(&mut self) -> Option<(u32, u32)> {
        if self.left == 0 {
            return None;
        }
        // Checked by scan_group: minimal varints, ordered runs, last <= MAX_BLOCK.
        let gap = varint::read(self.bytes, &mut self.offset, "a run").ok()?;
        let length = varint::read(self.bytes, &mut self.offset, "a run").ok()?;
        let first = self.next_start + u64::from(gap);
        let last = first + u64::from(length);
        self.next_start = last + 1;
        self.left -= 1;
        Some((first as u32, last as u32))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for Runs<'_> {}

/// The blocks of one [`GroupView`], in order.
#[derive(Clone, Debug)]
pub struct GroupBlocks<'a> {
    rel: RelFork,
    runs: Runs<'a>,
    /// Next block of the current run; past `last` when the run is used up.
    next: u64,
    last: u64,
    usage: &'a [u8],
    nibble: usize,
    left: u64,
}

impl Iterator for GroupBlocks<'_> {
    type Item = HotBlock;

    #[inline]
    fn next(&mut self) -> Option<HotBlock> {
        if self.left == 0 {
            return None;
        }
        if self.next > self.last {
            let (first, last) = self.runs.next()?;
            self.next = u64::from(first);
            self.last = u64::from(last);
        }
        let byte = *self.usage.get(self.nibble / 2)?;
        let usage = if self.nibble.is_multiple_of(2) { byte & 0x0F } else { byte >> 4 };
        let block = self.next as u32;
        self.next += 1;
        self.nibble += 1;
        self.left -= 1;
        Some(HotBlock { addr: self.rel.block(block), usage })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for GroupBlocks<'_> {}

/// Every block of a [`BlockListView`], in address order.
#[derive(Clone, Debug)]
pub struct Blocks<'a> {
    groups: Groups<'a>,
    current: Option<GroupBlocks<'a>>,
    left: u64,
}

impl Iterator for Blocks<'_> {
    type Item = HotBlock;

    #[inline]
    fn next(&mut self) -> Option<HotBlock> {
        loop {
            if let Some(block) = self.current.as_mut().and_then(Iterator::next) {
                self.left -= 1;
                return Some(block);
            }
            self.current = Some(self.groups.next()?.iter());
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for Blocks<'_> {}

impl BlockList {
    /// Decodes and validates every field, with no limit but the input's length (at most
    /// two blocks per input byte). Same as `decode_bounded(bytes, u64::MAX)`.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Self::decode_bounded(bytes, u64::MAX)
    }

    /// Decodes and validates every field, refusing a header that declares more than
    /// `max_blocks` blocks ([`DecodeError::TooManyBlocks`]) before anything is allocated.
    ///
    /// Memory, allocated with `try_reserve` as each relation fork passes validation
    /// (failure is [`DecodeError::OutOfMemory`], never an abort): about 5 bytes per block
    /// plus about 200 per relation fork. Blocks are at most min(`max_blocks`, 2 × input
    /// length); relation forks at most min(blocks, input length / 16). A malformed list is
    /// refused with the same error as [`BlockListView::parse`]; what it had allocated is
    /// freed.
    pub fn decode_bounded(bytes: &[u8], max_blocks: u64) -> Result<Self, DecodeError> {
        // Grown as relation forks pass validation, not reserved from the header's count.
        let mut groups: Vec<BlockGroup> = Vec::new();
        let header = walk(bytes, max_blocks, |group| {
            if groups.len() == groups.capacity() {
                groups.try_reserve(1).map_err(|_| DecodeError::OutOfMemory {
                    bytes: (groups.capacity() as u64 * 2).max(4) * std::mem::size_of::<BlockGroup>() as u64,
                })?;
            }
            let mut blocks: Vec<u32> = try_vec(group.len)?;
            let mut usage: Vec<u8> = try_vec(group.len)?;
            for block in group.iter() {
                blocks.push(block.addr.block);
                usage.push(block.usage);
            }
            groups.push(BlockGroup { rel: group.rel, blocks, usage }); // within capacity
            Ok(())
        })?;
        Ok(BlockList { header, groups })
    }

    /// Blocks in address order.
    pub fn iter(&self) -> impl Iterator<Item = HotBlock> + '_ {
        self.groups.iter().flat_map(|group| {
            group.blocks.iter().zip(&group.usage).map(move |(&block, &usage)| HotBlock { addr: group.rel.block(block), usage })
        })
    }

    pub fn len(&self) -> usize {
        self.header.blocks as usize
    }

    pub fn is_empty(&self) -> bool {
        self.header.blocks == 0
    }

    /// Re-encodes into batches of at most `max_blocks`, hottest blocks first (usage count
    /// descending, then address); each batch is a valid list sorted by address.
    ///
    /// Memory: about 30 bytes per block of this list, which its decoding bounded
    /// ([`decode_bounded`](Self::decode_bounded)'s `max_blocks`, or two blocks per input
    /// byte). These allocations are infallible: used outside a PostgreSQL backend (the
    /// agent), an allocation failure ends that process only.
    pub fn split_hottest_first(&self, max_blocks: usize) -> Vec<Vec<u8>> {
        self.hottest_batches(max_blocks, usize::MAX)
    }

    /// Re-encodes into batches of at most `max_blocks` in address (file) order, as
    /// autoprewarm reads its blocks: each batch is the next stretch of the list, so that a
    /// standby reads the files front to back. For a standby with room for the whole list,
    /// where no load evicts another; [`split_hottest_first`](Self::split_hottest_first)
    /// otherwise. Memory as there.
    pub fn split_in_file_order(&self, max_blocks: usize) -> Vec<Vec<u8>> {
        let blocks: Vec<HotBlock> = self.iter().collect();
        self.batches(&blocks, max_blocks)
    }

    /// [`split_hottest_first`](Self::split_hottest_first) of this list's `limit` hottest
    /// blocks only (the rest are left out).
    pub fn hottest_batches(&self, max_blocks: usize, limit: usize) -> Vec<Vec<u8>> {
        let mut blocks: Vec<HotBlock> = self.iter().collect();
        blocks.sort_by(|a, b| b.usage.cmp(&a.usage).then(a.addr.cmp(&b.addr)));
        blocks.truncate(limit);
        self.batches(&blocks, max_blocks)
    }

    /// `blocks` (of this list) in order, cut into lists of at most `max_blocks`, each with
    /// this list's header counts.
    fn batches(&self, blocks: &[HotBlock], max_blocks: usize) -> Vec<Vec<u8>> {
        assert!(max_blocks > 0, "batch size must be positive");
        blocks
            .chunks(max_blocks)
            .map(|chunk| {
                let mut batch = chunk.to_vec();
                encode_block_list(&mut batch, self.header.hot_buffers_found, self.header.buffers_scanned)
                    .expect("blocks of a valid list encode")
            })
            .collect()
    }
}
