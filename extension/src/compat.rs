//! Everything that differs between PostgreSQL major versions, in one place.
//!
//! The buffer tag layout, the relfilenode type and the signatures of the smgr and
//! buffer-manager calls changed in PostgreSQL 16 (RelFileNode became RelFileLocator,
//! BufferTag lost its nested struct). The rest of the extension speaks only
//! `ccm_codec::{BlockAddress, RelFork}` and calls the functions below, so porting to
//! another major version means porting this file and nothing else.

use ccm_codec::{BlockAddress, RelFork};
use pgrx::pg_sys;

#[cfg(not(feature = "pg15"))]
compile_error!(
    "pg_ccm is implemented for PostgreSQL 15 so far; porting means adapting src/compat.rs only"
);

/// The buffer descriptor of buffer slot `index` (0-based, < NBuffers).
///
/// `GetBufferDescriptor()` is a macro in PostgreSQL 15, so index the padded array directly.
///
/// # Safety
/// Shared memory must be attached and `index < NBuffers`.
#[inline(always)]
pub unsafe fn buffer_descriptor(index: usize) -> *mut pg_sys::BufferDesc {
    unsafe { std::ptr::addr_of_mut!((*pg_sys::BufferDescriptors.add(index)).bufferdesc) }
}

/// Reads a buffer tag as a block address.
#[inline(always)]
pub fn tag_address(tag: &pg_sys::BufferTag) -> BlockAddress {
    BlockAddress {
        spc: tag.rnode.spcNode.to_u32(),
        db: tag.rnode.dbNode.to_u32(),
        rel: tag.rnode.relNode.to_u32(),
        fork: tag.forkNum as u8,
        block: tag.blockNum,
    }
}

fn rel_file_node(rel: RelFork) -> pg_sys::RelFileNode {
    pg_sys::RelFileNode {
        spcNode: pg_sys::Oid::from_u32(rel.spc),
        dbNode: pg_sys::Oid::from_u32(rel.db),
        relNode: pg_sys::Oid::from_u32(rel.rel),
    }
}

/// Opens (or finds in the smgr cache) the storage manager relation of a relation fork.
///
/// The pointer is only good until the next invalidation is processed, so callers open
/// again instead of keeping it.
pub fn smgr_open(rel: RelFork) -> pg_sys::SMgrRelation {
    unsafe { pg_sys::smgropen(rel_file_node(rel), pg_sys::InvalidBackendId) }
}

/// Does the fork's first segment exist on disk?
pub fn fork_exists(rel: RelFork, fork: u8) -> bool {
    unsafe { pg_sys::smgrexists(smgr_open(rel), fork as pg_sys::ForkNumber::Type) }
}

/// Number of blocks in the fork. Raises an ERROR if the file vanished meanwhile.
pub fn fork_nblocks(rel: RelFork) -> u32 {
    unsafe { pg_sys::smgrnblocks(smgr_open(rel), rel.fork as pg_sys::ForkNumber::Type) }
}

/// Asks the kernel to start reading a block (posix_fadvise WILLNEED) unless it is
/// already in shared_buffers. Never raises an ERROR for a missing segment.
pub fn prefetch(address: &BlockAddress) {
    let rel = address.rel_fork();
    unsafe {
        pg_sys::PrefetchSharedBuffer(
            smgr_open(rel),
            rel.fork as pg_sys::ForkNumber::Type,
            address.block,
        );
    }
}

/// Reads a block into shared_buffers (or finds it there) and returns it pinned.
///
/// Works for any database from a backend connected to one, and on a hot standby.
/// Raises an ERROR when the file is gone or the block cannot be read.
pub fn read_buffer(address: &BlockAddress) -> pg_sys::Buffer {
    unsafe {
        pg_sys::ReadBufferWithoutRelcache(
            rel_file_node(address.rel_fork()),
            address.fork as pg_sys::ForkNumber::Type,
            address.block,
            pg_sys::ReadBufferMode::RBM_NORMAL,
            std::ptr::null_mut(),
            true,
        )
    }
}

/// Discards every shared buffer of the fork from `first_block` on, without writing.
///
/// Used only for blocks that no longer exist on disk (relation dropped or truncated
/// while we were reading it), which is exactly what recovery does for them.
pub fn drop_buffers_from(rel: RelFork, first_block: u32) {
    let mut fork = rel.fork as pg_sys::ForkNumber::Type;
    let mut first = first_block;
    unsafe { pg_sys::DropRelFileNodeBuffers(smgr_open(rel), &mut fork, 1, &mut first) };
}

/// Path of the fork's first segment file, relative to the data directory (the working
/// directory of every backend). Later segments append ".1", ".2", ...
pub fn relation_path(rel: RelFork) -> String {
    unsafe {
        let path = pg_sys::GetRelationPath(
            pg_sys::Oid::from_u32(rel.db),
            pg_sys::Oid::from_u32(rel.spc),
            pg_sys::Oid::from_u32(rel.rel),
            pg_sys::InvalidBackendId,
            rel.fork as pg_sys::ForkNumber::Type,
        );
        let owned = std::ffi::CStr::from_ptr(path).to_string_lossy().into_owned();
        pg_sys::pfree(path.cast());
        owned
    }
}

/// The WAL flush position and the timeline WAL is being inserted on
/// (`GetFlushRecPtr()` returns the timeline since PostgreSQL 15).
pub fn wal_flush_position() -> (u64, u32) {
    let mut timeline: pg_sys::TimeLineID = 0;
    let flush = unsafe { pg_sys::GetFlushRecPtr(&mut timeline) };
    (flush, timeline)
}

/// `ReplicationSlotControlLock`, a macro over `MainLWLockArray` (index 37 in 15).
pub fn replication_slot_control_lock() -> *mut pg_sys::LWLock {
    unsafe { std::ptr::addr_of_mut!((*pg_sys::MainLWLockArray.add(37)).lock) }
}
