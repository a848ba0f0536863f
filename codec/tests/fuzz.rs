//! Property tests ("fuzzing" on stable Rust) and the corpus-driven regression test.
//!
//! The corpus in tests/corpus/{filter,block_list}/ holds `ok-*.bin` inputs that must
//! decode and `bad-*.bin` inputs that must be refused. Missing seed files are written
//! by `corpus_seeds_exist`; an input that ever broke a decoder belongs there too.
//!
//! Every list input also checks that the three readers agree: `BlockList::decode`,
//! `BlockList::decode_bounded` and the streaming `BlockListView` accept the same inputs,
//! refuse the others with the same error, and yield the same blocks.

use std::fs;
use std::path::{Path, PathBuf};

use ccm_codec::{encode_block_list, BlockList, BlockListView, DecodeError, FilterBuilder, FilterView, HotBlock, RelFork};
use proptest::prelude::*;

fn arbitrary_blocks() -> impl Strategy<Value = Vec<HotBlock>> {
    let block = (0u32..4, 0u32..3, 16384u32..16390, 0u8..=3, prop_oneof![0u32..300, 0u32..=ccm_codec::MAX_BLOCK], 0u8..=5);
    prop::collection::vec(block, 0..400).prop_map(|raw| {
        raw.into_iter()
            .map(|(spc, db, rel, fork, block, usage)| HotBlock { addr: RelFork { spc: 1663 + spc, db, rel, fork }.block(block), usage })
            .collect()
    })
}

fn valid_list() -> Vec<u8> {
    let rel = RelFork { spc: 1663, db: 5, rel: 16384, fork: 0 };
    let mut blocks: Vec<HotBlock> = (0..50).chain(90..95).map(|b| HotBlock { addr: rel.block(b), usage: 4 + (b % 2) as u8 }).collect();
    encode_block_list(&mut blocks, 55, 1000).unwrap()
}

/// One relation fork, one run of `blocks` blocks, and usage nibbles (all 0) for `nibbles`.
fn one_long_run(blocks: u32, nibbles: u32) -> Vec<u8> {
    let mut out = b"CCMB\x01\0\0\0".to_vec();
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&blocks.to_le_bytes());
    out.extend_from_slice(&[0; 16]);
    out.extend_from_slice(&[0x7f, 0x06, 0, 0, 5, 0, 0, 0, 0, 0x40, 0, 0, 0, 1, 0]);
    let mut length = blocks - 1;
    while length >= 0x80 {
        out.push((length as u8) | 0x80);
        length >>= 7;
    }
    out.push(length as u8);
    out.resize(out.len() + nibbles.div_ceil(2) as usize, 0);
    out
}

fn valid_filter() -> Vec<u8> {
    let mut builder = FilterBuilder::new(100, 0.01, 77).unwrap();
    let rel = RelFork { spc: 1663, db: 5, rel: 16384, fork: 0 };
    for block in 0..100 {
        builder.insert(&rel.block(block));
    }
    builder.finish()
}

/// Decodes a list every way there is; all must agree. Returns the decoder's verdict.
fn decode_every_way(bytes: &[u8]) -> Result<BlockList, DecodeError> {
    let decoded = BlockList::decode(bytes);
    let viewed = BlockListView::parse(bytes);
    match (&decoded, &viewed) {
        (Ok(list), Ok(view)) => {
            assert_eq!(view.header(), list.header);
            let streamed: Vec<HotBlock> = view.iter().collect();
            assert_eq!(streamed, list.iter().collect::<Vec<_>>(), "streaming differs from decoding");
            assert_eq!(view.iter().len(), list.len());
            let groups: Vec<(RelFork, usize)> = view.groups().map(|g| (g.rel(), g.len())).collect();
            assert_eq!(groups, list.groups.iter().map(|g| (g.rel, g.blocks.len())).collect::<Vec<_>>());
            // The limit is inclusive and checked before anything else about the body.
            let blocks = u64::from(list.header.blocks);
            assert_eq!(BlockList::decode_bounded(bytes, blocks).as_ref(), Ok(list));
            if blocks > 0 {
                let over = DecodeError::TooManyBlocks { declared: blocks, limit: blocks - 1 };
                assert_eq!(BlockList::decode_bounded(bytes, blocks - 1), Err(over.clone()));
                assert_eq!(BlockListView::parse_bounded(bytes, blocks - 1).map(|v| v.len()), Err(over));
            }
        }
        (Err(error), Err(same)) => assert_eq!(error, same, "the view refuses with another error than decode"),
        _ => panic!("decode says {:?}, the view says {:?}", decoded.as_ref().map(BlockList::len), viewed.map(|v| v.len())),
    }
    decoded
}

/// A decoded list must re-encode to exactly the same bytes: the encoding is canonical.
fn check_list(bytes: &[u8]) {
    if let Ok(list) = decode_every_way(bytes) {
        let mut blocks: Vec<HotBlock> = list.iter().collect();
        let again = encode_block_list(&mut blocks, list.header.hot_buffers_found, list.header.buffers_scanned).unwrap();
        assert_eq!(again, bytes, "a decodable list is not canonical");
    }
}

fn check_filter(bytes: &[u8]) {
    if let Ok(view) = FilterView::parse(bytes) {
        let rel = RelFork { spc: 1, db: 2, rel: 3, fork: 0 };
        let _ = view.contains(&rel.block(4));
        assert!(view.estimated_false_positive_rate() <= 1.0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn lists_round_trip(blocks in arbitrary_blocks()) {
        let mut input = blocks.clone();
        let bytes = encode_block_list(&mut input, 1, 2).unwrap();
        let decoded = BlockList::decode(&bytes).unwrap();
        prop_assert_eq!(decoded.iter().collect::<Vec<_>>(), input);
    }

    #[test]
    fn streaming_equals_decoding(blocks in arbitrary_blocks(), found in any::<u64>(), scanned in any::<u64>()) {
        let mut input = blocks;
        let bytes = encode_block_list(&mut input, found, scanned).unwrap();
        let view = BlockListView::parse(&bytes).unwrap();
        prop_assert_eq!(view.iter().collect::<Vec<_>>(), input.clone());
        prop_assert_eq!(view.iter().len(), input.len());
        // Every prefix of the stream is right too (size hints stay exact as it goes).
        let mut stream = view.iter();
        for (i, expected) in input.iter().enumerate() {
            prop_assert_eq!(stream.len(), input.len() - i);
            prop_assert_eq!(stream.next(), Some(*expected));
        }
        prop_assert!(stream.next().is_none());
        check_list(&bytes);
    }

    #[test]
    fn batches_cover_the_list(blocks in arbitrary_blocks(), size in 1usize..64) {
        let mut input = blocks;
        let list = BlockList::decode(&encode_block_list(&mut input, 0, 0).unwrap()).unwrap();
        let batches: Vec<BlockList> = list.split_hottest_first(size).iter().map(|b| BlockList::decode(b).unwrap()).collect();
        prop_assert!(batches.iter().all(|b| b.len() <= size));
        let mut union: Vec<HotBlock> = batches.iter().flat_map(|b| b.iter().collect::<Vec<_>>()).collect();
        union.sort_by_key(|b| b.addr);
        prop_assert_eq!(union, input);
        for pair in batches.windows(2) {
            let coldest = pair[0].iter().map(|b| b.usage).min();
            let hottest_next = pair[1].iter().map(|b| b.usage).max();
            prop_assert!(coldest >= hottest_next);
        }
    }

    #[test]
    fn batches_in_file_order_cover_the_list_in_order(blocks in arbitrary_blocks(), size in 1usize..64) {
        let mut input = blocks;
        let list = BlockList::decode(&encode_block_list(&mut input, 0, 0).unwrap()).unwrap();
        let batches: Vec<BlockList> = list.split_in_file_order(size).iter().map(|b| BlockList::decode(b).unwrap()).collect();
        prop_assert!(batches.iter().all(|b| b.len() <= size && !b.is_empty()));
        let joined: Vec<HotBlock> = batches.iter().flat_map(|b| b.iter().collect::<Vec<_>>()).collect();
        prop_assert_eq!(joined, input);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        check_list(&bytes);
        check_filter(&bytes);
    }

    #[test]
    fn random_bytes_behind_a_valid_header_never_panic(tail in prop::collection::vec(any::<u8>(), 0..300), groups in 0u32..8, blocks in 0u32..64) {
        let mut bytes = valid_list()[..32].to_vec();
        bytes[8..12].copy_from_slice(&groups.to_le_bytes());
        bytes[12..16].copy_from_slice(&blocks.to_le_bytes());
        bytes.extend(tail);
        check_list(&bytes);
    }

    #[test]
    fn mutated_lists_never_panic(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6), cut in any::<prop::sample::Index>()) {
        let mut bytes = valid_list();
        for (index, value) in edits {
            let at = index.index(bytes.len());
            bytes[at] = value;
        }
        check_list(&bytes);
        check_list(&bytes[..cut.index(bytes.len() + 1)]);
    }

    #[test]
    fn mutated_filters_never_panic(edits in prop::collection::vec((0usize..32, any::<u8>()), 1..4)) {
        let mut bytes = valid_filter();
        for (at, value) in edits {
            bytes[at] = value;
        }
        check_filter(&bytes);
    }
}

fn corpus_dir(kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(kind)
}

fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let list = valid_list();
    let filter = valid_filter();
    let patched = |bytes: &[u8], at: usize, value: &[u8]| {
        let mut copy = bytes.to_vec();
        copy[at..at + value.len()].copy_from_slice(value);
        copy
    };
    let mut empty = Vec::new();
    vec![
        ("block_list", "ok-small", list.clone()),
        ("block_list", "ok-empty", encode_block_list(&mut empty, 0, 0).unwrap()),
        ("block_list", "bad-empty-input", Vec::new()),
        ("block_list", "bad-truncated", list[..list.len() - 1].to_vec()),
        ("block_list", "bad-trailing", [list.as_slice(), &[0]].concat()),
        ("block_list", "bad-magic", patched(&list, 0, b"XXXX")),
        ("block_list", "bad-version", patched(&list, 4, &[2])),
        ("block_list", "bad-flags", patched(&list, 5, &[1])),
        ("block_list", "bad-huge-groups", patched(&list, 8, &u32::MAX.to_le_bytes())),
        ("block_list", "bad-huge-blocks", patched(&list, 12, &u32::MAX.to_le_bytes())),
        ("block_list", "bad-fork", patched(&list, 32 + 12, &[7])),
        ("block_list", "bad-usage", patched(&list, list.len() - 1, &[0x0F])),
        ("block_list", "bad-filter-as-list", filter.clone()),
        // The shape of the safety review's 50 MB list (one run, usage nibbles of 0), small.
        ("block_list", "ok-one-long-run", one_long_run(2001, 2001)),
        ("block_list", "bad-one-long-run-short-usage", one_long_run(2001, 2000)),
        ("block_list", "bad-one-long-run-more-declared", patched(&one_long_run(2001, 2001), 12, &2002u32.to_le_bytes())),
        ("block_list", "bad-one-long-run-padding", { let mut l = one_long_run(2001, 2001); *l.last_mut().unwrap() = 0x10; l }),
        ("filter", "ok-small", filter.clone()),
        ("filter", "bad-empty-input", Vec::new()),
        ("filter", "bad-truncated", filter[..filter.len() - 8].to_vec()),
        ("filter", "bad-magic", patched(&filter, 0, b"CCMB")),
        ("filter", "bad-version", patched(&filter, 4, &[0])),
        ("filter", "bad-hashes", patched(&filter, 5, &[0])),
        ("filter", "bad-bits", patched(&filter, 24, &(1u64 << 40).to_le_bytes())),
        ("filter", "bad-list-as-filter", list),
    ]
}

#[test]
fn corpus_seeds_exist() {
    for (kind, name, bytes) in seeds() {
        let dir = corpus_dir(kind);
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.bin"));
        if !path.exists() {
            fs::write(&path, bytes).unwrap();
        }
    }
}

#[test]
fn corpus_inputs_decode_or_fail_as_named() {
    let mut checked = 0;
    for kind in ["block_list", "filter"] {
        let Ok(entries) = fs::read_dir(corpus_dir(kind)) else { continue };
        for entry in entries {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let bytes = fs::read(&path).unwrap();
            let decoded = match kind {
                "block_list" => decode_every_way(&bytes).map(|_| ()),
                _ => FilterView::parse(&bytes).map(|_| ()),
            };
            match (name.starts_with("ok-"), decoded) {
                (true, Err(error)) => panic!("{kind}/{name} should decode: {error}"),
                (false, Ok(())) => panic!("{kind}/{name} should be refused"),
                _ => checked += 1,
            }
        }
    }
    assert!(checked >= seeds().len(), "corpus has only {checked} files");
}
