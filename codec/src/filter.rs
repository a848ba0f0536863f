//! Bloom filter of block addresses: what a standby caches, so the primary can skip it.
//!
//! Format v1, little endian:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `CCMF` |
//! | 4 | version (1) |
//! | 5 | hash count k, 1..=30 |
//! | 6..8 | reserved, 0 |
//! | 8..16 | seed |
//! | 16..24 | item count (informational) |
//! | 24..32 | bit count m: a multiple of 64, 64..=2^32 |
//! | 32.. | m/8 bytes: u64 words, bit i in word i/64 at position i%64 |
//!
//! The key's xxh3-128 (seeded) gives h1 and h2 (made odd); probe i is bit
//! `(h1 + i*h2) * m >> 64` (multiply-shift range reduction, no division).
//!
//! Memory: [`FilterView`] reads a serialized filter in place and allocates nothing.
//! [`FilterBuilder`] holds the serialized form itself (header and bit array, one
//! allocation of m/8 + 32 bytes, made with `try_reserve`), and `finish()` hands that buffer
//! over without a copy. Its rate is at least [`FILTER_MIN_FALSE_POSITIVE_RATE`], so a
//! filter costs at most about 29 bits per expected item (and never more than 2^32 bits).

use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::address::BlockAddress;
use crate::error::{DecodeError, FilterParamError};

pub const FILTER_MAGIC: [u8; 4] = *b"CCMF";
pub const FILTER_VERSION: u8 = 1;
pub const FILTER_HEADER_LEN: usize = 32;
pub const FILTER_MAX_BITS: u64 = 1 << 32;
pub const FILTER_MAX_HASHES: u8 = 30;
/// Smallest false-positive rate a builder accepts: about 28.8 bits per item. Lower rates
/// buy nothing the transfer needs (a false positive only delays a block by one cycle) and
/// would let one call allocate up to 2^32 bits.
pub const FILTER_MIN_FALSE_POSITIVE_RATE: f64 = 1e-6;

/// A rate as PostgreSQL prints a float8: plain for ordinary values, with an exponent for
/// tiny or huge ones (`1e-300`, not three hundred zeros).
pub fn format_rate(rate: f64) -> String {
    let magnitude = rate.abs();
    if rate == 0.0 || !rate.is_finite() || (1e-4..1e15).contains(&magnitude) {
        format!("{rate}")
    } else {
        format!("{rate:e}")
    }
}

/// The k bit positions of a key, in a filter of `bits` bits.
#[inline(always)]
fn probes(addr: &BlockAddress, seed: u64, hashes: u8, bits: u64) -> impl Iterator<Item = u64> {
    let hash = xxh3_128_with_seed(&addr.key(), seed);
    let h1 = hash as u64;
    let h2 = ((hash >> 64) as u64) | 1;
    (0..u64::from(hashes)).map(move |i| {
        let mixed = h1.wrapping_add(i.wrapping_mul(h2));
        ((u128::from(mixed) * u128::from(bits)) >> 64) as u64
    })
}

/// Sizing: m = -n ln p / ln²2 bits (rounded up to whole words), k = m/n ln 2.
fn dimensions(expected_items: u64, false_positive_rate: f64) -> (u64, u8) {
    let n = expected_items.max(1) as f64;
    let ln2 = std::f64::consts::LN_2;
    let ideal_bits = (-n * false_positive_rate.ln() / (ln2 * ln2)).ceil();
    let bits = if ideal_bits >= FILTER_MAX_BITS as f64 {
        FILTER_MAX_BITS
    } else {
        ((ideal_bits as u64).div_ceil(64) * 64).max(64)
    };
    let hashes = ((bits as f64 / n) * ln2).round().clamp(1.0, f64::from(FILTER_MAX_HASHES));
    (bits, hashes as u8)
}

/// Builds a filter in its serialized form; `finish()` returns those bytes.
#[derive(Clone, Debug)]
pub struct FilterBuilder {
    /// Header (item count written by `finish`) and bit array.
    bytes: Vec<u8>,
    bits: u64,
    hashes: u8,
    seed: u64,
    items: u64,
}

impl FilterBuilder {
    /// A filter sized for `expected_items` at `false_positive_rate`, which must lie in
    /// [`FILTER_MIN_FALSE_POSITIVE_RATE`], 1). Its one allocation is made with
    /// `try_reserve`: failure is [`FilterParamError::OutOfMemory`], not an abort.
    pub fn new(expected_items: u64, false_positive_rate: f64, seed: u64) -> Result<Self, FilterParamError> {
        if !(FILTER_MIN_FALSE_POSITIVE_RATE..1.0).contains(&false_positive_rate) {
            return Err(FilterParamError::FalsePositiveRate(false_positive_rate));
        }
        let (bits, hashes) = dimensions(expected_items, false_positive_rate);
        let total = FILTER_HEADER_LEN as u64 + bits / 8;
        let out_of_memory = FilterParamError::OutOfMemory { bytes: total };
        let len = usize::try_from(total).map_err(|_| out_of_memory.clone())?;
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(len).map_err(|_| out_of_memory)?;
        bytes.extend_from_slice(&FILTER_MAGIC);
        bytes.push(FILTER_VERSION);
        bytes.push(hashes);
        bytes.extend_from_slice(&0u16.to_le_bytes());
        bytes.extend_from_slice(&seed.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes()); // item count, set by finish()
        bytes.extend_from_slice(&bits.to_le_bytes());
        bytes.resize(len, 0); // within the reserved capacity
        Ok(FilterBuilder { bytes, bits, hashes, seed, items: 0 })
    }

    pub fn insert(&mut self, addr: &BlockAddress) {
        let bit_array = &mut self.bytes[FILTER_HEADER_LEN..];
        for bit in probes(addr, self.seed, self.hashes, self.bits) {
            bit_array[(bit / 8) as usize] |= 1 << (bit % 8);
        }
        self.items += 1;
    }

    pub fn contains(&self, addr: &BlockAddress) -> bool {
        let bit_array = &self.bytes[FILTER_HEADER_LEN..];
        probes(addr, self.seed, self.hashes, self.bits).all(|bit| bit_array[(bit / 8) as usize] & (1 << (bit % 8)) != 0)
    }

    pub fn bit_count(&self) -> u64 {
        self.bits
    }

    pub fn hash_count(&self) -> u8 {
        self.hashes
    }

    /// The serialized filter: the builder's own buffer, not a copy.
    pub fn finish(mut self) -> Vec<u8> {
        self.bytes[16..24].copy_from_slice(&self.items.to_le_bytes());
        self.bytes
    }
}

/// A serialized filter, validated and read in place: parsing checks the header and the
/// length and borrows the bit array, so it allocates nothing whatever the input.
#[derive(Clone, Copy, Debug)]
pub struct FilterView<'a> {
    bit_array: &'a [u8],
    bits: u64,
    hashes: u8,
    seed: u64,
    items: u64,
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(bytes[offset..offset + 8].try_into().expect("8 bytes"))
}

impl<'a> FilterView<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        if bytes.len() >= 4 && bytes[0..4] != FILTER_MAGIC {
            return Err(DecodeError::BadMagic { expected: "filter" });
        }
        if bytes.len() < FILTER_HEADER_LEN {
            return Err(DecodeError::ShortHeader { len: bytes.len(), needed: FILTER_HEADER_LEN });
        }
        if bytes[4] != FILTER_VERSION {
            return Err(DecodeError::UnsupportedVersion { found: bytes[4], supported: FILTER_VERSION });
        }
        let hashes = bytes[5];
        if hashes == 0 || hashes > FILTER_MAX_HASHES {
            return Err(DecodeError::HashCount(hashes));
        }
        let reserved = u16::from_le_bytes([bytes[6], bytes[7]]);
        if reserved != 0 {
            return Err(DecodeError::Reserved { field: "filter flags", value: u64::from(reserved) });
        }
        let seed = u64_at(bytes, 8);
        let items = u64_at(bytes, 16);
        let bits = u64_at(bytes, 24);
        if bits == 0 || !bits.is_multiple_of(64) || bits > FILTER_MAX_BITS {
            return Err(DecodeError::BitCount(bits));
        }
        let expected = FILTER_HEADER_LEN as u64 + bits / 8;
        if bytes.len() as u64 != expected {
            return Err(DecodeError::LengthMismatch { len: bytes.len(), expected });
        }
        Ok(FilterView { bit_array: &bytes[FILTER_HEADER_LEN..], bits, hashes, seed, items })
    }

    #[inline]
    pub fn contains(&self, addr: &BlockAddress) -> bool {
        probes(addr, self.seed, self.hashes, self.bits)
            .all(|bit| self.bit_array[(bit / 8) as usize] & (1 << (bit % 8)) != 0)
    }

    pub fn bit_count(&self) -> u64 {
        self.bits
    }

    pub fn hash_count(&self) -> u8 {
        self.hashes
    }

    pub fn item_count(&self) -> u64 {
        self.items
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn ones(&self) -> u64 {
        self.bit_array
            .chunks_exact(8)
            .map(|word| u64::from(u64::from_le_bytes(word.try_into().expect("8 bytes")).count_ones()))
            .sum()
    }

    /// (fraction of bits set)^k: the false-positive rate this filter actually has.
    pub fn estimated_false_positive_rate(&self) -> f64 {
        (self.ones() as f64 / self.bits as f64).powi(i32::from(self.hashes))
    }
}
