//! ccm-codec: the two binary formats pg_ccm exchanges as `bytea`, in plain Rust.
//!
//! - [`filter`]: a bloom filter of the buffer tags a standby caches (`CCMF`, v1);
//! - [`block_list`]: a compact, sorted list of hot blocks and their usage counts (`CCMB`, v1).
//!
//! Both come from SQL callers, so every decoder validates every field and never panics.
//! The views ([`FilterView`], [`BlockListView`]) read their input in place and allocate
//! nothing; [`BlockList::decode_bounded`] checks the caller's block limit against the
//! header before it allocates, and every allocation sized by input is made with
//! `try_reserve`, so that a failure is an error value ([`DecodeError::OutOfMemory`],
//! [`FilterParamError::OutOfMemory`]) rather than an abort of the host process. The byte
//! layouts are documented in each module.

pub mod address;
pub mod block_list;
pub mod error;
pub mod filter;
mod varint;

pub use address::{BlockAddress, HotBlock, RelFork, MAX_BLOCK, MAX_FORK, MAX_USAGE};
pub use block_list::{
    decode_block_list_header, encode_block_list, BlockGroup, BlockList, BlockListEncoder, BlockListHeader,
    BlockListView, Blocks, GroupBlocks, GroupView, Groups, Runs, BLOCK_LIST_HEADER_LEN, BLOCK_LIST_MAGIC,
    BLOCK_LIST_VERSION,
};
pub use error::{DecodeError, DecodeErrorKind, EncodeError, FilterParamError};
pub use filter::{
    format_rate, FilterBuilder, FilterView, FILTER_HEADER_LEN, FILTER_MAGIC, FILTER_MAX_BITS, FILTER_MAX_HASHES,
    FILTER_MIN_FALSE_POSITIVE_RATE, FILTER_VERSION,
};
