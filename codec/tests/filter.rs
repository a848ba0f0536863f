//! Bloom filter: sizing, false-positive rate, seeds, and every malformed input.

use ccm_codec::{
    format_rate, BlockAddress, DecodeError, FilterBuilder, FilterParamError, FilterView, FILTER_MIN_FALSE_POSITIVE_RATE,
};

fn address(i: u64) -> BlockAddress {
    BlockAddress { spc: 1663, db: 5 + (i % 3) as u32, rel: 16384 + (i / 100_000) as u32, fork: (i % 2) as u8, block: i as u32 }
}

fn built(items: u64, rate: f64, seed: u64) -> Vec<u8> {
    let mut builder = FilterBuilder::new(items, rate, seed).unwrap();
    for i in 0..items {
        builder.insert(&address(i));
    }
    builder.finish()
}

#[test]
fn no_false_negatives_and_rate_within_bounds() {
    for rate in [0.01, 0.001] {
        let bytes = built(100_000, rate, 42);
        let view = FilterView::parse(&bytes).unwrap();
        assert!((0..100_000).all(|i| view.contains(&address(i))), "false negative at p={rate}");
        let trials = 200_000u64;
        let false_positives = (0..trials).filter(|i| view.contains(&address(1_000_000 + i))).count();
        let measured = false_positives as f64 / trials as f64;
        assert!(measured > 0.5 * rate && measured < 1.5 * rate, "p={rate}: measured {measured}");
        let estimated = view.estimated_false_positive_rate();
        assert!((estimated - measured).abs() < 0.3 * rate, "estimated {estimated}, measured {measured}");
    }
}

#[test]
fn one_percent_costs_at_most_ten_bits_per_item() {
    for items in [1_000u64, 100_000, 1_000_000] {
        let builder = FilterBuilder::new(items, 0.01, 1).unwrap();
        let bits_per_item = builder.bit_count() as f64 / items as f64;
        assert!(bits_per_item <= 10.0, "{bits_per_item} bits per item for {items}");
        assert_eq!(builder.hash_count(), 7);
    }
}

#[test]
fn a_false_positive_under_one_seed_is_not_one_under_every_seed() {
    let filters: Vec<Vec<u8>> = (0..20).map(|seed| built(10_000, 0.01, seed)).collect();
    let views: Vec<FilterView<'_>> = filters.iter().map(|f| FilterView::parse(f).unwrap()).collect();
    let mut ever_hidden = 0;
    for probe in 0..50_000u64 {
        let key = address(5_000_000 + probe);
        let hidden = views.iter().filter(|v| v.contains(&key)).count();
        assert!(hidden < views.len(), "{key:?} is a false positive under every seed");
        ever_hidden += usize::from(hidden > 0);
    }
    assert!(ever_hidden > 0, "20 filters at 1% should have some false positives");
}

#[test]
fn header_fields_round_trip() {
    let bytes = built(1234, 0.01, 0xDEAD_BEEF);
    let view = FilterView::parse(&bytes).unwrap();
    assert_eq!(view.item_count(), 1234);
    assert_eq!(view.seed(), 0xDEAD_BEEF);
    assert_eq!(bytes.len() as u64, 32 + view.bit_count() / 8);
    assert!(view.ones() > 0 && view.ones() < view.bit_count());
}

#[test]
fn empty_filter_is_valid_and_contains_nothing() {
    let bytes = FilterBuilder::new(0, 0.01, 3).unwrap().finish();
    let view = FilterView::parse(&bytes).unwrap();
    assert_eq!(view.bit_count(), 64);
    assert!(!view.contains(&address(1)));
}

#[test]
fn bad_rates_are_refused() {
    for rate in [0.0, 1.0, -0.5, 2.0, f64::NAN, f64::INFINITY, 1e-300, 9.9e-7, f64::MIN_POSITIVE] {
        assert!(matches!(FilterBuilder::new(10, rate, 0), Err(FilterParamError::FalsePositiveRate(_))), "{rate}");
    }
    assert_eq!(
        FilterParamError::FalsePositiveRate(2.0).to_string(),
        "the false-positive rate must be at least 1e-6 and less than 1, got 2"
    );
}

#[test]
fn the_smallest_rate_is_bounded_in_size() {
    // 1e-6 costs about 28.8 bits per item (and the format caps any filter at 2^32 bits).
    let builder = FilterBuilder::new(1_000_000, FILTER_MIN_FALSE_POSITIVE_RATE, 1).unwrap();
    assert!(builder.bit_count() <= 29 * 1_000_000, "{} bits", builder.bit_count());
}

#[test]
fn rates_print_as_postgresql_prints_them() {
    assert_eq!(format_rate(0.01), "0.01");
    assert_eq!(format_rate(1e-300), "1e-300");
    assert_eq!(format_rate(1.5e-7), "1.5e-7");
    assert_eq!(format_rate(0.0), "0");
    assert_eq!(format_rate(f64::NAN), "NaN");
}

fn valid() -> Vec<u8> {
    built(500, 0.01, 9)
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = valid();
    for len in 0..bytes.len() {
        let error = FilterView::parse(&bytes[..len]).unwrap_err();
        assert!(
            matches!(error, DecodeError::ShortHeader { .. } | DecodeError::LengthMismatch { .. }),
            "prefix of {len}: {error:?}"
        );
    }
}

#[test]
fn malformed_headers_are_named() {
    let bytes = valid();
    let with = |offset: usize, value: &[u8]| {
        let mut copy = bytes.clone();
        copy[offset..offset + value.len()].copy_from_slice(value);
        FilterView::parse(&copy).unwrap_err()
    };
    assert!(matches!(with(0, b"CCMB"), DecodeError::BadMagic { .. }));
    assert!(matches!(with(4, &[2]), DecodeError::UnsupportedVersion { found: 2, supported: 1 }));
    assert!(matches!(with(5, &[0]), DecodeError::HashCount(0)));
    assert!(matches!(with(5, &[31]), DecodeError::HashCount(31)));
    assert!(matches!(with(6, &[1, 0]), DecodeError::Reserved { .. }));
    assert!(matches!(with(24, &100u64.to_le_bytes()), DecodeError::BitCount(100)));
    assert!(matches!(with(24, &0u64.to_le_bytes()), DecodeError::BitCount(0)));
    assert!(matches!(with(24, &(1u64 << 40).to_le_bytes()), DecodeError::BitCount(_)));
    assert!(matches!(with(24, &128u64.to_le_bytes()), DecodeError::LengthMismatch { .. }));
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(FilterView::parse(&longer).unwrap_err(), DecodeError::LengthMismatch { .. }));
    assert!(matches!(FilterView::parse(b"").unwrap_err(), DecodeError::ShortHeader { len: 0, .. }));
}
