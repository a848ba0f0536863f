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

unsafe extern "C-unwind" {
    /// utils/relfilenodemap.h, which pgrx does not bind (`RelidByRelfilenumber` from 16 on).
    /// May raise an ERROR: call it through `pg_guard_ffi_boundary`.
    fn RelidByRelfilenode(reltablespace: pg_sys::Oid, relfilenode: pg_sys::Oid) -> pg_sys::Oid;
}

/// The OID of the relation whose storage is `rel`, looked up as autoprewarm does: in the
/// current database's pg_class, or in the relation mapper for mapped and shared catalogs.
/// `None` when no relation of this database has that storage (dropped, rewritten, not yet
/// visible, or of another database). The answer is a hint until the relation is locked:
/// callers lock it and then check `relation_has_storage`.
pub fn relation_oid(rel: RelFork) -> Option<pg_sys::Oid> {
    let (spc, relfilenode) = (pg_sys::Oid::from_u32(rel.spc), pg_sys::Oid::from_u32(rel.rel));
    // SAFETY: an ERROR inside is turned into a Rust panic that pgrx re-raises as that ERROR.
    let oid = unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| RelidByRelfilenode(spc, relfilenode)) };
    (oid != pg_sys::InvalidOid).then_some(oid)
}

/// Is `relation`'s storage (as its relcache entry says now) the one `rel` names?
///
/// # Safety
/// `relation` must be an open relation.
pub unsafe fn relation_has_storage(relation: pg_sys::Relation, rel: RelFork) -> bool {
    let node = unsafe { (*relation).rd_node };
    node.spcNode.to_u32() == rel.spc && node.dbNode.to_u32() == rel.db && node.relNode.to_u32() == rel.rel
}

/// Does the relation's fork exist on disk?
///
/// # Safety
/// `relation` must be open and locked.
pub unsafe fn fork_exists(relation: pg_sys::Relation, fork: u8) -> bool {
    let smgr = unsafe { pg_sys::smgropen((*relation).rd_node, pg_sys::InvalidBackendId) };
    unsafe { pg_sys::smgrexists(smgr, fork as pg_sys::ForkNumber::Type) }
}

/// Number of blocks in the relation's fork (which must exist).
///
/// # Safety
/// `relation` must be open and locked.
pub unsafe fn fork_nblocks(relation: pg_sys::Relation, fork: u8) -> u32 {
    unsafe { pg_sys::RelationGetNumberOfBlocksInFork(relation, fork as pg_sys::ForkNumber::Type) }
}

/// Asks the kernel to start reading a block (posix_fadvise WILLNEED) unless it is already
/// in shared_buffers, as pg_prewarm's 'prefetch' mode does.
///
/// # Safety
/// `relation` must be open and locked, and `block` below the fork's size.
pub unsafe fn prefetch(relation: pg_sys::Relation, fork: u8, block: u32) {
    unsafe { pg_sys::PrefetchBuffer(relation, fork as pg_sys::ForkNumber::Type, block) };
}

/// Reads a block into shared_buffers (or finds it there) and returns it pinned, as
/// pg_prewarm's 'buffer' mode does. Raises an ERROR if a main or init fork block cannot be
/// read. Free-space-map and visibility-map pages are read as PostgreSQL itself reads them
/// (fsm_readbuf, vm_readbuf): they are not protected by full-page writes, so a torn page is
/// zeroed (with a WARNING) instead of failing the read.
///
/// # Safety
/// `relation` must be open and locked, and `block` below the fork's size.
pub unsafe fn read_buffer(relation: pg_sys::Relation, fork: u8, block: u32) -> pg_sys::Buffer {
    let fork = fork as pg_sys::ForkNumber::Type;
    let mode = match fork {
        pg_sys::ForkNumber::FSM_FORKNUM | pg_sys::ForkNumber::VISIBILITYMAP_FORKNUM => {
            pg_sys::ReadBufferMode::RBM_ZERO_ON_ERROR
        }
        _ => pg_sys::ReadBufferMode::RBM_NORMAL,
    };
    unsafe { pg_sys::ReadBufferExtended(relation, fork, block, mode, std::ptr::null_mut()) }
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
