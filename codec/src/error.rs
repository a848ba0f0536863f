//! Errors of the decoders and encoders. Display texts are lowercase fragments without a
//! final period; the extension turns them into DETAIL sentences.
//!
//! Two decode errors say nothing about the input's validity: `TooManyBlocks` (a valid list
//! larger than the caller accepts) and `OutOfMemory` (an allocation that failed). Their
//! kinds, `TooLarge` and `OutOfMemory`, let the caller raise the right SQLSTATE.

/// Broad class of a decode error, for choosing a hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeErrorKind {
    Truncated,
    BadMagic,
    UnsupportedVersion,
    Corrupt,
    /// Well-formed as far as checked, but over the limit the caller set.
    TooLarge,
    /// Memory for the decoded form could not be allocated.
    OutOfMemory,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("input is {len} bytes, shorter than the {needed}-byte header")]
    ShortHeader { len: usize, needed: usize },
    #[error("input ends at byte {len} inside {field}")]
    Truncated { len: usize, field: &'static str },
    #[error("input does not start with the magic number of a pg_ccm {expected}")]
    BadMagic { expected: &'static str },
    #[error("format version {found} is not supported; this build reads version {supported}")]
    UnsupportedVersion { found: u8, supported: u8 },
    #[error("reserved field {field} is {value}, expected 0")]
    Reserved { field: &'static str, value: u64 },
    #[error("hash count {0} is out of range (1 to {max})", max = crate::filter::FILTER_MAX_HASHES)]
    HashCount(u8),
    #[error("bit count {0} is not a positive multiple of 64 up to {max}", max = crate::filter::FILTER_MAX_BITS)]
    BitCount(u64),
    #[error("input is {len} bytes but the header declares {expected}")]
    LengthMismatch { len: usize, expected: u64 },
    #[error("header declares {declared} {what} but {len} bytes hold at most {possible}")]
    TooMany { what: &'static str, declared: u64, possible: u64, len: usize },
    #[error("relation fork {index} is not after the previous one")]
    GroupOrder { index: u32 },
    #[error("fork number {0} is out of range (0 to 3)")]
    Fork(u8),
    #[error("relation fork {index} has no runs")]
    NoRuns { index: u32 },
    #[error("run {run} of relation fork {index} touches or precedes the previous run")]
    RunOrder { index: u32, run: u32 },
    #[error("run {run} of relation fork {index} goes past block {max}", max = crate::address::MAX_BLOCK)]
    BlockRange { index: u32, run: u32 },
    #[error("varint at byte {offset} is longer than 5 bytes or exceeds 32 bits")]
    VarintOverflow { offset: usize },
    #[error("varint at byte {offset} is not minimally encoded")]
    VarintNotMinimal { offset: usize },
    #[error("usage count {value} at block {block} of relation fork {index} exceeds {max}", max = crate::address::MAX_USAGE)]
    Usage { index: u32, block: u32, value: u8 },
    #[error("padding nibble of relation fork {index} is not zero")]
    Padding { index: u32 },
    #[error("header declares {declared} blocks but the relation forks hold {found}")]
    BlockCount { declared: u32, found: u64 },
    #[error("{0} bytes follow the last relation fork")]
    TrailingBytes(usize),
    #[error("header declares {declared} blocks but at most {limit} are accepted here")]
    TooManyBlocks { declared: u64, limit: u64 },
    #[error("could not allocate {bytes} bytes")]
    OutOfMemory { bytes: u64 },
}

impl DecodeError {
    pub fn kind(&self) -> DecodeErrorKind {
        match self {
            DecodeError::ShortHeader { .. } | DecodeError::Truncated { .. } => DecodeErrorKind::Truncated,
            DecodeError::BadMagic { .. } => DecodeErrorKind::BadMagic,
            DecodeError::UnsupportedVersion { .. } => DecodeErrorKind::UnsupportedVersion,
            DecodeError::TooManyBlocks { .. } => DecodeErrorKind::TooLarge,
            DecodeError::OutOfMemory { .. } => DecodeErrorKind::OutOfMemory,
            _ => DecodeErrorKind::Corrupt,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FilterParamError {
    /// Not in [`FILTER_MIN_FALSE_POSITIVE_RATE`](crate::filter::FILTER_MIN_FALSE_POSITIVE_RATE), 1).
    #[error(
        "the false-positive rate must be at least {min} and less than 1, got {rate}",
        min = crate::filter::format_rate(crate::filter::FILTER_MIN_FALSE_POSITIVE_RATE),
        rate = crate::filter::format_rate(*.0)
    )]
    FalsePositiveRate(f64),
    #[error("could not allocate {bytes} bytes for the filter")]
    OutOfMemory { bytes: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("block {next:?} does not follow {previous:?}")]
    Unsorted { previous: crate::BlockAddress, next: crate::BlockAddress },
    #[error("usage count {0} exceeds {max}", max = crate::address::MAX_USAGE)]
    Usage(u8),
    #[error("fork number {0} is out of range (0 to 3)")]
    Fork(u8),
    #[error("block number {0} is out of range")]
    Block(u32),
    #[error("more than {max} blocks", max = u32::MAX)]
    TooManyBlocks,
    #[error("could not allocate {bytes} bytes")]
    OutOfMemory { bytes: u64 },
}
