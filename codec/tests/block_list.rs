//! Block list: round trips, sizes, batching, and every malformed input.

use std::time::Instant;

use ccm_codec::{
    decode_block_list_header, encode_block_list, BlockList, BlockListEncoder, BlockListView, DecodeError, EncodeError,
    HotBlock, RelFork,
};

const REL: RelFork = RelFork { spc: 1663, db: 5, rel: 16384, fork: 0 };

fn hot(rel: RelFork, block: u32, usage: u8) -> HotBlock {
    HotBlock { addr: rel.block(block), usage }
}

fn encode(mut blocks: Vec<HotBlock>) -> Vec<u8> {
    encode_block_list(&mut blocks, 7, 9).unwrap()
}

fn sample() -> Vec<HotBlock> {
    let other = RelFork { rel: 16390, fork: 1, ..REL };
    vec![hot(REL, 0, 5), hot(REL, 1, 4), hot(REL, 2, 5), hot(REL, 10, 4), hot(REL, 200_000, 5), hot(other, 3, 4), hot(other, 4, 4)]
}

#[test]
fn round_trip_keeps_blocks_usage_and_header() {
    let bytes = encode(sample());
    let list = BlockList::decode(&bytes).unwrap();
    assert_eq!(list.iter().collect::<Vec<_>>(), sample());
    assert_eq!((list.header.groups, list.header.blocks), (2, 7));
    assert_eq!((list.header.hot_buffers_found, list.header.buffers_scanned), (7, 9));
    assert_eq!(decode_block_list_header(&bytes).unwrap(), list.header);
}

#[test]
fn encoding_sorts_and_keeps_the_hotter_duplicate() {
    let mut shuffled = sample();
    shuffled.reverse();
    shuffled.push(hot(REL, 1, 2));
    assert_eq!(encode(shuffled), encode(sample()));
}

#[test]
fn encoder_refuses_unsorted_and_out_of_range_input() {
    let mut encoder = BlockListEncoder::new();
    encoder.push(hot(REL, 5, 5)).unwrap();
    assert!(matches!(encoder.push(hot(REL, 5, 5)), Err(EncodeError::Unsorted { .. })));
    assert!(matches!(encoder.push(hot(REL, 4, 5)), Err(EncodeError::Unsorted { .. })));
    assert!(matches!(encoder.push(hot(REL, 6, 6)), Err(EncodeError::Usage(6))));
    assert!(matches!(encoder.push(hot(RelFork { fork: 4, ..REL }, 6, 1)), Err(EncodeError::Fork(4))));
    assert!(matches!(encoder.push(hot(REL, u32::MAX, 1)), Err(EncodeError::Block(_))));
    assert_eq!(encoder.len(), 1);
}

#[test]
fn empty_list_is_valid() {
    let bytes = encode(Vec::new());
    assert_eq!(bytes.len(), 32);
    assert!(BlockList::decode(&bytes).unwrap().is_empty());
}

#[test]
fn sizes_clustered_and_scattered() {
    // Clustered: 100 000 consecutive blocks in 10 relations.
    let clustered: Vec<HotBlock> = (0..10)
        .flat_map(|r| (0..10_000).map(move |b| hot(RelFork { rel: 16384 + r, ..REL }, b, 4 + (b % 2) as u8)))
        .collect();
    let clustered_bytes = encode(clustered.clone()).len() as f64 / clustered.len() as f64;
    // Scattered: 100 000 random blocks of a 1 GB (131 072-block) relation.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let scattered: Vec<HotBlock> = (0..100_000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            hot(REL, (state % 131_072) as u32, 5)
        })
        .collect();
    let mut unique = scattered.clone();
    unique.sort_by_key(|b| b.addr);
    unique.dedup_by_key(|b| b.addr);
    let scattered_bytes = encode(scattered).len() as f64 / unique.len() as f64;
    println!("bytes per block: clustered {clustered_bytes:.3}, scattered {scattered_bytes:.3}");
    assert!(clustered_bytes <= 2.0, "{clustered_bytes}");
    assert!(scattered_bytes <= 4.0, "{scattered_bytes}");
}

#[test]
fn batches_are_hottest_first_and_cover_the_list() {
    let list = BlockList::decode(&encode(sample())).unwrap();
    let batches = list.split_hottest_first(3);
    assert_eq!(batches.len(), 3);
    let decoded: Vec<BlockList> = batches.iter().map(|b| BlockList::decode(b).unwrap()).collect();
    assert!(decoded[0].iter().all(|b| b.usage == 5));
    assert_eq!(decoded.iter().map(BlockList::len).collect::<Vec<_>>(), vec![3, 3, 1]);
    let mut union: Vec<HotBlock> = decoded.iter().flat_map(|l| l.iter().collect::<Vec<_>>()).collect();
    union.sort_by_key(|b| b.addr);
    assert_eq!(union, sample());
    assert_eq!(decoded[2].header.hot_buffers_found, 7);
}

#[test]
fn batches_in_file_order_are_consecutive_stretches_of_the_list() {
    let list = BlockList::decode(&encode(sample())).unwrap();
    let batches: Vec<BlockList> = list.split_in_file_order(3).iter().map(|b| BlockList::decode(b).unwrap()).collect();
    assert_eq!(batches.iter().map(BlockList::len).collect::<Vec<_>>(), vec![3, 3, 1]);
    let joined: Vec<HotBlock> = batches.iter().flat_map(|l| l.iter().collect::<Vec<_>>()).collect();
    assert_eq!(joined, sample(), "the batches, one after the other, are the list in address order");
    assert_eq!(batches[2].header.hot_buffers_found, 7);
}

#[test]
fn capped_batches_keep_the_hottest_blocks_only() {
    let list = BlockList::decode(&encode(sample())).unwrap();
    let mut hottest: Vec<HotBlock> = list.iter().collect();
    hottest.sort_by(|a, b| b.usage.cmp(&a.usage).then(a.addr.cmp(&b.addr)));
    hottest.truncate(4);
    let batches = list.hottest_batches(2, 4);
    assert_eq!(batches.len(), 2);
    let kept: Vec<HotBlock> = batches.iter().flat_map(|b| BlockList::decode(b).unwrap().iter().collect::<Vec<_>>()).collect();
    assert!(kept.iter().all(|b| hottest.contains(b)) && kept.len() == 4, "{kept:?}");
    assert!(list.hottest_batches(3, 0).is_empty());
}

fn valid() -> Vec<u8> {
    encode(sample())
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = valid();
    for len in 0..bytes.len() {
        refused(&bytes[..len]);
    }
}

/// The decoder's error, after checking that the streaming view refuses with the same one.
fn refused(bytes: &[u8]) -> DecodeError {
    let error = BlockList::decode(bytes).unwrap_err();
    assert_eq!(BlockListView::parse(bytes).unwrap_err(), error, "the view disagrees on {bytes:02x?}");
    assert_eq!(BlockList::decode_bounded(bytes, u64::MAX).unwrap_err(), error);
    error
}

fn with(bytes: &[u8], offset: usize, value: &[u8]) -> DecodeError {
    let mut copy = bytes.to_vec();
    copy[offset..offset + value.len()].copy_from_slice(value);
    refused(&copy)
}

#[test]
fn malformed_headers_are_named() {
    let bytes = valid();
    assert!(matches!(refused(b""), DecodeError::ShortHeader { len: 0, .. }));
    assert!(matches!(with(&bytes, 0, b"CCMF"), DecodeError::BadMagic { .. }));
    assert!(matches!(with(&bytes, 4, &[9]), DecodeError::UnsupportedVersion { found: 9, supported: 1 }));
    assert!(matches!(with(&bytes, 5, &[1]), DecodeError::Reserved { .. }));
    assert!(matches!(with(&bytes, 6, &[0, 1]), DecodeError::Reserved { .. }));
    assert!(matches!(with(&bytes, 12, &8u32.to_le_bytes()), DecodeError::BlockCount { declared: 8, .. }));
    assert!(matches!(with(&bytes, 12, &6u32.to_le_bytes()), DecodeError::BlockCount { declared: 6, .. }));
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert!(matches!(refused(&trailing), DecodeError::TrailingBytes(1)));
}

#[test]
fn huge_declared_counts_fail_fast_without_allocating() {
    let mut bytes = encode(vec![hot(REL, 1, 5)]);
    bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    let started = Instant::now();
    assert!(matches!(BlockList::decode(&bytes).unwrap_err(), DecodeError::TooMany { what: "relation forks", .. }));
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    bytes[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(BlockList::decode(&bytes).unwrap_err(), DecodeError::TooMany { what: "blocks", .. }));
    // A run claiming four billion blocks in a list that declares one.
    let mut long_run = encode(vec![hot(REL, 1, 5)]);
    let run_length_offset = 32 + 13 + 1 + 1;
    long_run.splice(run_length_offset..run_length_offset + 1, [0xFF, 0xFF, 0xFF, 0xFF, 0x0A]); // ~2.9e9 blocks, in range
    assert!(matches!(refused(&long_run), DecodeError::BlockCount { .. }));
    assert!(started.elapsed().as_millis() < 100);
}

/// Hand-assembles a one-group list: header, group header, raw run bytes, raw usage bytes.
fn assembled(groups: &[(RelFork, Vec<u8>, Vec<u8>)], blocks: u32) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"CCMB");
    out.extend_from_slice(&[1, 0, 0, 0]);
    out.extend_from_slice(&(groups.len() as u32).to_le_bytes());
    out.extend_from_slice(&blocks.to_le_bytes());
    out.extend_from_slice(&[0; 16]);
    for (rel, runs, usage) in groups {
        out.extend_from_slice(&rel.spc.to_le_bytes());
        out.extend_from_slice(&rel.db.to_le_bytes());
        out.extend_from_slice(&rel.rel.to_le_bytes());
        out.push(rel.fork);
        out.extend_from_slice(runs);
        out.extend_from_slice(usage);
    }
    out
}

#[test]
fn assembled_reference_list_decodes() {
    // Runs: [3..=4], then gap 1 after 4 -> starts at 6, length 1. Usage 5,4,5.
    let bytes = assembled(&[(REL, vec![2, 3, 1, 1, 0], vec![0x45, 0x05])], 3);
    let blocks: Vec<(u32, u8)> = BlockList::decode(&bytes).unwrap().iter().map(|b| (b.addr.block, b.usage)).collect();
    assert_eq!(blocks, vec![(3, 5), (4, 4), (6, 5)]);
    let view = BlockListView::parse(&bytes).unwrap();
    assert_eq!(view.iter().map(|b| (b.addr.block, b.usage)).collect::<Vec<_>>(), blocks);
    let group = view.groups().next().unwrap();
    assert_eq!((group.rel(), group.len(), group.runs().collect::<Vec<_>>()), (REL, 3, vec![(3, 4), (6, 6)]));
}

#[test]
fn malformed_bodies_are_named() {
    let ok_runs = vec![1, 3, 0];
    let decode = |groups: &[(RelFork, Vec<u8>, Vec<u8>)], blocks| refused(&assembled(groups, blocks));
    assert!(matches!(decode(&[(RelFork { fork: 4, ..REL }, ok_runs.clone(), vec![5])], 1), DecodeError::Fork(4)));
    assert!(matches!(decode(&[(REL, vec![0, 3, 0, 0, 0], vec![5])], 1), DecodeError::NoRuns { .. } | DecodeError::TrailingBytes(_)));
    assert!(matches!(decode(&[(REL, vec![2, 3, 0, 0, 0], vec![0x55])], 2), DecodeError::RunOrder { run: 1, .. }));
    assert!(matches!(decode(&[(REL, vec![1, 0xFE, 0xFF, 0xFF, 0xFF, 0x0F, 1], vec![0x55])], 2), DecodeError::BlockRange { .. }));
    assert!(matches!(decode(&[(REL, vec![1, 0x80, 0x80, 0x80, 0x80, 0x80, 0], vec![5])], 1), DecodeError::VarintOverflow { .. }));
    assert!(matches!(decode(&[(REL, vec![1, 0x83, 0x00, 0], vec![5])], 1), DecodeError::VarintNotMinimal { .. }));
    assert!(matches!(decode(&[(REL, ok_runs.clone(), vec![0xF5])], 1), DecodeError::Padding { .. }));
    assert!(matches!(decode(&[(REL, vec![1, 3, 1], vec![0x5F])], 2), DecodeError::Usage { value: 0x0F, .. }));
    assert!(matches!(decode(&[(REL, ok_runs.clone(), vec![5]), (REL, ok_runs.clone(), vec![5])], 2), DecodeError::GroupOrder { index: 1 }));
    let lower = RelFork { rel: 1, ..REL };
    assert!(matches!(decode(&[(REL, ok_runs.clone(), vec![5]), (lower, ok_runs.clone(), vec![5])], 2), DecodeError::GroupOrder { index: 1 }));
    assert!(matches!(decode(&[(REL, ok_runs.clone(), vec![5])], 2), DecodeError::BlockCount { declared: 2, found: 1 } | DecodeError::TooMany { .. }));
}
