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
        match self.groups.last_mut() {
            Some(group) if group.rel == rel => {
                group.blocks.push(addr.block);
                group.usage.push(block.usage);
            }
            _ => self.groups.push(BlockGroup { rel, blocks: vec![addr.block], usage: vec![block.usage] }),
        }
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

    pub fn finish(self, hot_buffers_found: u64, buffers_scanned: u64) -> Vec<u8> {
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

/// (start, length) of each maximal run of consecutive blocks.
fn runs(blocks: &[u32]) -> Vec<(u32, u32)> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &block in blocks {
        match runs.last_mut() {
            Some((start, length)) if u64::from(*start) + u64::from(*length) == u64::from(block) => *length += 1,
            _ => runs.push((block, 1)),
        }
    }
    runs
}

fn encode_groups(header: &BlockListHeader, groups: &[BlockGroup]) -> Vec<u8> {
    let mut out = Vec::with_capacity(BLOCK_LIST_HEADER_LEN + groups.len() * 20 + header.blocks as usize);
    write_header(&mut out, header);
    for group in groups {
        out.extend_from_slice(&group.rel.spc.to_le_bytes());
        out.extend_from_slice(&group.rel.db.to_le_bytes());
        out.extend_from_slice(&group.rel.rel.to_le_bytes());
        out.push(group.rel.fork);
        let runs = runs(&group.blocks);
        varint::write(&mut out, runs.len() as u32);
        let mut previous_end: Option<u32> = None;
        for (start, length) in runs {
            let gap = match previous_end {
                None => start,
                Some(end) => start - end - 1,
            };
            varint::write(&mut out, gap);
            varint::write(&mut out, length - 1);
            previous_end = Some(start + (length - 1));
        }
        for pair in group.usage.chunks(2) {
            out.push(pair[0] | pair.get(1).map_or(0, |high| high << 4));
        }
    }
    out
}

/// Sorts by address (keeping the higher usage of duplicates) and encodes.
pub fn encode_block_list(blocks: &mut Vec<HotBlock>, hot_buffers_found: u64, buffers_scanned: u64) -> Result<Vec<u8>, EncodeError> {
    blocks.sort_unstable_by(|a, b| a.addr.cmp(&b.addr).then(b.usage.cmp(&a.usage)));
    blocks.dedup_by_key(|block| block.addr);
    let mut encoder = BlockListEncoder::new();
    for block in blocks.iter() {
        encoder.push(*block)?;
    }
    Ok(encoder.finish(hot_buffers_found, buffers_scanned))
}

fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes(bytes[offset..offset + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(bytes[offset..offset + 8].try_into().expect("8 bytes"))
}

/// Validates and returns the header alone (cheap: does not read the groups).
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

fn read_group(bytes: &[u8], offset: &mut usize, index: u32, remaining_blocks: u64) -> Result<BlockGroup, DecodeError> {
    if bytes.len() < *offset + 13 {
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
    let mut blocks = Vec::new();
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
        if blocks.len() as u64 + length > remaining_blocks {
            return Err(DecodeError::BlockCount { declared: 0, found: blocks.len() as u64 + length });
        }
        blocks.extend(start as u32..=end as u32);
        next_start = end + 1;
    }
    let usage_bytes = blocks.len().div_ceil(2);
    let Some(packed) = bytes.get(*offset..*offset + usage_bytes) else {
        return Err(DecodeError::Truncated { len: bytes.len(), field: "usage counts" });
    };
    *offset += usage_bytes;
    let mut usage = Vec::with_capacity(blocks.len());
    for (i, &block) in blocks.iter().enumerate() {
        let value = if i % 2 == 0 { packed[i / 2] & 0x0F } else { packed[i / 2] >> 4 };
        if value > MAX_USAGE {
            return Err(DecodeError::Usage { index, block, value });
        }
        usage.push(value);
    }
    if blocks.len() % 2 == 1 && packed[usage_bytes - 1] >> 4 != 0 {
        return Err(DecodeError::Padding { index });
    }
    Ok(BlockGroup { rel, blocks, usage })
}

impl BlockList {
    /// Decodes and validates every field.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let header = decode_block_list_header(bytes)?;
        let mut offset = BLOCK_LIST_HEADER_LEN;
        let mut groups: Vec<BlockGroup> = Vec::with_capacity(header.groups as usize);
        let mut found: u64 = 0;
        for index in 0..header.groups {
            let group = read_group(bytes, &mut offset, index, u64::from(header.blocks) - found)
                .map_err(|error| match error {
                    DecodeError::BlockCount { found: in_group, .. } => {
                        DecodeError::BlockCount { declared: header.blocks, found: found + in_group }
                    }
                    other => other,
                })?;
            if groups.last().is_some_and(|previous| previous.rel >= group.rel) {
                return Err(DecodeError::GroupOrder { index });
            }
            found += group.blocks.len() as u64;
            groups.push(group);
        }
        if found != u64::from(header.blocks) {
            return Err(DecodeError::BlockCount { declared: header.blocks, found });
        }
        if offset != bytes.len() {
            return Err(DecodeError::TrailingBytes(bytes.len() - offset));
        }
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
    pub fn split_hottest_first(&self, max_blocks: usize) -> Vec<Vec<u8>> {
        assert!(max_blocks > 0, "batch size must be positive");
        let mut blocks: Vec<HotBlock> = self.iter().collect();
        blocks.sort_by(|a, b| b.usage.cmp(&a.usage).then(a.addr.cmp(&b.addr)));
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
