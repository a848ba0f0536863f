//! Everything that differs between PostgreSQL major versions, in one place.
//!
//! - 16: RelFileNode became RelFileLocator (`rd_node` is `rd_locator`), BufferTag lost its
//!   nested struct (`spcOid, dbOid, relNumber`), `RelidByRelfilenode` became
//!   `RelidByRelfilenumber`.
//! - 17: backends are numbered by ProcNumber (`INVALID_PROC_NUMBER`, not
//!   `InvalidBackendId`), PGPROC's `lxid` moved into `vxid`, and buffers can be read through a read stream (read_stream.h),
//!   which pgrx does not bind: it is declared here.
//! - 16: `debug_io_direct` can bypass the kernel's page cache for relation data.
//! - 18: `GetRelationPath` returns its path by value (`RelPathStr`); `pqsignal` is a macro
//!   over `pqsignal_be`; read streams submit asynchronous I/O (io_method).
//!
//! The rest of the extension speaks only `ccm_codec::{BlockAddress, RelFork}` and calls the
//! functions below, so porting to another major version means porting this file and
//! nothing else. Each version's layout was read from its headers (server/storage/buf_internals.h,
//! utils/rel.h, common/relpath.h, storage/read_stream.h, storage/lwlocknames.h).

use ccm_codec::{BlockAddress, RelFork};
use pgrx::pg_sys;

#[cfg(not(any(feature = "pg15", feature = "pg16", feature = "pg17", feature = "pg18")))]
compile_error!("pg_ccm supports PostgreSQL 15 to 18: build with one of the features pg15, pg16, pg17, pg18");

/// PostgreSQL 17 and later read through read streams (see `stream_reads`).
pub const HAS_READ_STREAMS: bool = cfg!(any(feature = "pg17", feature = "pg18"));

/// "No backend" for smgr and path calls: `InvalidBackendId` (15, 16) and
/// `INVALID_PROC_NUMBER` (17+) are both -1.
const NO_BACKEND: i32 = -1;

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
#[cfg(feature = "pg15")]
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

/// Reads a buffer tag as a block address.
#[cfg(not(feature = "pg15"))]
#[inline(always)]
pub fn tag_address(tag: &pg_sys::BufferTag) -> BlockAddress {
    BlockAddress {
        spc: tag.spcOid.to_u32(),
        db: tag.dbOid.to_u32(),
        rel: tag.relNumber.to_u32(),
        fork: tag.forkNum as u8,
        block: tag.blockNum,
    }
}

unsafe extern "C-unwind" {
    /// utils/relfilenodemap.h (15) and relfilenumbermap.h (16+), which pgrx does not bind.
    /// May raise an ERROR: call it through `pg_guard_ffi_boundary`.
    #[cfg_attr(feature = "pg15", link_name = "RelidByRelfilenode")]
    #[cfg_attr(not(feature = "pg15"), link_name = "RelidByRelfilenumber")]
    fn relid_by_relfilenumber(reltablespace: pg_sys::Oid, relfilenumber: pg_sys::Oid) -> pg_sys::Oid;
}

/// The OID of the relation whose storage is `rel`, looked up as autoprewarm does: in the
/// current database's pg_class, or in the relation mapper for mapped and shared catalogs.
/// `None` when no relation of this database has that storage (dropped, rewritten, not yet
/// visible, or of another database). The answer is a hint until the relation is locked:
/// callers lock it and then check `relation_has_storage`.
pub fn relation_oid(rel: RelFork) -> Option<pg_sys::Oid> {
    let (spc, relfilenode) = (pg_sys::Oid::from_u32(rel.spc), pg_sys::Oid::from_u32(rel.rel));
    // SAFETY: an ERROR inside is turned into a Rust panic that pgrx re-raises as that ERROR.
    let oid = unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| relid_by_relfilenumber(spc, relfilenode)) };
    (oid != pg_sys::InvalidOid).then_some(oid)
}

/// Is `relation`'s storage (as its relcache entry says now) the one `rel` names?
///
/// # Safety
/// `relation` must be an open relation.
pub unsafe fn relation_has_storage(relation: pg_sys::Relation, rel: RelFork) -> bool {
    #[cfg(feature = "pg15")]
    let (spc, db, number) = {
        let node = unsafe { (*relation).rd_node };
        (node.spcNode, node.dbNode, node.relNode)
    };
    #[cfg(not(feature = "pg15"))]
    let (spc, db, number) = {
        let locator = unsafe { (*relation).rd_locator };
        (locator.spcOid, locator.dbOid, locator.relNumber)
    };
    spc.to_u32() == rel.spc && db.to_u32() == rel.db && number.to_u32() == rel.rel
}

/// Does the relation's fork exist on disk?
///
/// # Safety
/// `relation` must be open and locked.
pub unsafe fn fork_exists(relation: pg_sys::Relation, fork: u8) -> bool {
    // What RelationGetSmgr() (a static inline function) does, without keeping the result.
    #[cfg(feature = "pg15")]
    let smgr = unsafe { pg_sys::smgropen((*relation).rd_node, (*relation).rd_backend) };
    #[cfg(not(feature = "pg15"))]
    let smgr = unsafe { pg_sys::smgropen((*relation).rd_locator, (*relation).rd_backend) };
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

/// Reads the blocks `next` hands out, one fork of one relation, and gives each to `each`
/// pinned, with the byte `next` attached to it; `each` must release it. Returns, when `next`
/// has said `None` and every block handed out has reached `each`, how many of them were
/// found in shared_buffers (the reads' buffer hits, counted around the reads only: opening a
/// stream can read catalogs, such as pg_tablespace for the I/O concurrency).
///
/// On 17 and later the main and init forks are read through a read stream, as pg_prewarm
/// (17, 18) and autoprewarm (18) read: the stream combines neighbouring blocks into one
/// read and keeps up to maintenance_io_concurrency reads in flight ahead of `each`, with
/// posix_fadvise (17) or asynchronous I/O (18, io_method). Flags as 18's pg_prewarm:
/// MAINTENANCE (maintenance_io_concurrency, not the sessions' effective_io_concurrency),
/// FULL (no ramp-up: every block handed out is wanted), and on 18 USE_BATCHING, which
/// requires that `next` never blocks. Before 17, and for the free-space and visibility
/// maps (read with RBM_ZERO_ON_ERROR, which streams do not offer), blocks are read one at a
/// time with `read_buffer`.
///
/// `next` runs inside the stream's C code: it must not call PostgreSQL, block, or raise an
/// ERROR. A panic in it ends the stream and is re-raised afterwards.
///
/// # Safety
/// `relation` must be open and locked, and every block handed out below the fork's size.
pub unsafe fn stream_reads(
    relation: pg_sys::Relation,
    fork: u8,
    next: &mut dyn FnMut() -> Option<(u32, u8)>,
    mut each: impl FnMut(pg_sys::Buffer, u8),
) -> u64 {
    let map_fork = matches!(
        fork as pg_sys::ForkNumber::Type,
        pg_sys::ForkNumber::FSM_FORKNUM | pg_sys::ForkNumber::VISIBILITYMAP_FORKNUM
    );
    if HAS_READ_STREAMS && !map_fork {
        #[cfg(any(feature = "pg17", feature = "pg18"))]
        return unsafe { read_stream::read_all(relation, fork, next, each) };
    }
    let mut cached = 0;
    while let Some((block, byte)) = next() {
        let hits = buffer_hits();
        let buffer = unsafe { read_buffer(relation, fork, block) };
        cached += buffer_hits() - hits;
        each(buffer, byte);
    }
    cached
}

/// This backend's shared buffer hits so far (pgBufferUsage.shared_blks_hit).
fn buffer_hits() -> u64 {
    unsafe { pg_sys::pgBufferUsage.shared_blks_hit as u64 }
}

/// storage/read_stream.h (17+), which pgrx does not bind.
#[cfg(any(feature = "pg17", feature = "pg18"))]
mod read_stream {
    use std::ffi::{c_int, c_void};
    use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

    use pgrx::pg_sys;
    use pgrx::pg_sys::ffi::pg_guard_ffi_boundary;

    const READ_STREAM_MAINTENANCE: c_int = 0x01;
    const READ_STREAM_FULL: c_int = 0x04;
    #[cfg(feature = "pg18")]
    const READ_STREAM_USE_BATCHING: c_int = 0x08;
    #[cfg(feature = "pg18")]
    const FLAGS: c_int = READ_STREAM_MAINTENANCE | READ_STREAM_FULL | READ_STREAM_USE_BATCHING;
    #[cfg(not(feature = "pg18"))]
    const FLAGS: c_int = READ_STREAM_MAINTENANCE | READ_STREAM_FULL;

    type BlockCallback = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void) -> pg_sys::BlockNumber;

    unsafe extern "C-unwind" {
        fn read_stream_begin_relation(
            flags: c_int,
            strategy: pg_sys::BufferAccessStrategy,
            rel: pg_sys::Relation,
            forknum: pg_sys::ForkNumber::Type,
            callback: BlockCallback,
            callback_private_data: *mut c_void,
            per_buffer_data_size: usize,
        ) -> *mut c_void;
        fn read_stream_next_buffer(stream: *mut c_void, per_buffer_data: *mut *mut c_void) -> pg_sys::Buffer;
        fn read_stream_end(stream: *mut c_void);
    }

    /// What the callback reaches through `callback_private_data`.
    struct Source<'a> {
        next: &'a mut dyn FnMut() -> Option<(u32, u8)>,
        panic: Option<Box<dyn std::any::Any + Send>>,
    }

    /// The stream's block-number callback: the next block, its byte stored in the stream's
    /// per-buffer data, or InvalidBlockNumber at the end (and after a panic).
    unsafe extern "C" fn next_block(_stream: *mut c_void, private: *mut c_void, per_buffer: *mut c_void) -> pg_sys::BlockNumber {
        let source = unsafe { &mut *private.cast::<Source>() };
        if source.panic.is_some() {
            return pg_sys::InvalidBlockNumber;
        }
        match catch_unwind(AssertUnwindSafe(|| (source.next)())) {
            Ok(Some((block, byte))) => {
                unsafe { per_buffer.cast::<u8>().write(byte) };
                block
            }
            Ok(None) => pg_sys::InvalidBlockNumber,
            Err(panic) => {
                source.panic = Some(panic);
                pg_sys::InvalidBlockNumber
            }
        }
    }

    pub(super) unsafe fn read_all(
        relation: pg_sys::Relation,
        fork: u8,
        next: &mut dyn FnMut() -> Option<(u32, u8)>,
        mut each: impl FnMut(pg_sys::Buffer, u8),
    ) -> u64 {
        let mut source = Source { next, panic: None };
        let private = std::ptr::addr_of_mut!(source).cast::<c_void>();
        let fork = fork as pg_sys::ForkNumber::Type;
        // SAFETY: the stream lives in this frame's memory context; an ERROR while it is open
        // (a failed read) leaves it to the transaction's abort, which releases its pins, as
        // for pg_prewarm's stream.
        let cached;
        unsafe {
            let stream = pg_guard_ffi_boundary(|| {
                read_stream_begin_relation(FLAGS, std::ptr::null_mut(), relation, fork, next_block, private, 1)
            });
            // A stream counts a hit when it looks ahead, not when it hands the buffer out.
            let hits = super::buffer_hits();
            loop {
                let mut per_buffer: *mut c_void = std::ptr::null_mut();
                let buffer = pg_guard_ffi_boundary(|| read_stream_next_buffer(stream, &mut per_buffer));
                if buffer == pg_sys::InvalidBuffer as pg_sys::Buffer {
                    break;
                }
                each(buffer, per_buffer.cast::<u8>().read());
            }
            cached = super::buffer_hits() - hits;
            pg_guard_ffi_boundary(|| read_stream_end(stream));
        }
        if let Some(panic) = source.panic {
            resume_unwind(panic);
        }
        cached
    }
}

/// Path of the fork's first segment file, relative to the data directory (the working
/// directory of every backend). Later segments append ".1", ".2", ...
pub fn relation_path(rel: RelFork) -> String {
    let (db, spc, number) = (pg_sys::Oid::from_u32(rel.db), pg_sys::Oid::from_u32(rel.spc), pg_sys::Oid::from_u32(rel.rel));
    let fork = rel.fork as pg_sys::ForkNumber::Type;
    #[cfg(not(feature = "pg18"))]
    unsafe {
        let path = pg_sys::GetRelationPath(db, spc, number, NO_BACKEND, fork);
        let owned = std::ffi::CStr::from_ptr(path).to_string_lossy().into_owned();
        pg_sys::pfree(path.cast());
        owned
    }
    #[cfg(feature = "pg18")]
    unsafe {
        let path = pg_sys::GetRelationPath(db, spc, number, NO_BACKEND, fork);
        std::ffi::CStr::from_ptr(path.str_.as_ptr()).to_string_lossy().into_owned()
    }
}

/// Directory of database `db` in tablespace `spc`, relative to the data directory:
/// `base/<db>` (1663), `global` (1664), `pg_tblspc/<spc>/<TABLESPACE_VERSION_DIRECTORY>/<db>`
/// for the others (GetDatabasePath, whose version directory names the major version and the
/// catalog version).
pub fn database_path(spc: u32, db: u32) -> String {
    unsafe {
        let path = pg_sys::GetDatabasePath(pg_sys::Oid::from_u32(db), pg_sys::Oid::from_u32(spc));
        let owned = std::ffi::CStr::from_ptr(path).to_string_lossy().into_owned();
        pg_sys::pfree(path.cast());
        owned
    }
}

/// Does this server read and write relation data with direct I/O, past the kernel's page
/// cache (`debug_io_direct` naming `data`, PostgreSQL 16 and later)? Then the page cache
/// holds no relation data worth measuring or warming.
pub fn data_bypasses_page_cache() -> bool {
    #[cfg(feature = "pg15")]
    return false;
    #[cfg(not(feature = "pg15"))]
    unsafe {
        let value = pg_sys::GetConfigOption(c"debug_io_direct".as_ptr(), true, false);
        !value.is_null() && io_direct_names_data(&std::ffi::CStr::from_ptr(value).to_string_lossy())
    }
}

/// Whether a `debug_io_direct` setting (a list such as `data, wal`) names `data`.
#[cfg_attr(feature = "pg15", allow(dead_code))]
pub fn io_direct_names_data(setting: &str) -> bool {
    setting.split(',').any(|item| item.trim().trim_matches('"').eq_ignore_ascii_case("data"))
}

/// Installs a signal handler in a background worker (`pqsignal`, a macro from 18 on).
///
/// # Safety
/// Only in a background worker, before it unblocks signals.
pub unsafe fn set_signal_handler(signal: i32, handler: unsafe extern "C-unwind" fn(std::ffi::c_int)) {
    #[cfg(not(feature = "pg18"))]
    unsafe {
        pg_sys::pqsignal(signal, Some(handler))
    };
    #[cfg(feature = "pg18")]
    unsafe {
        pg_sys::pqsignal_be(signal, Some(handler))
    };
}

/// The WAL flush position and the timeline WAL is being inserted on
/// (`GetFlushRecPtr()` returns the timeline since PostgreSQL 15).
pub fn wal_flush_position() -> (u64, u32) {
    let mut timeline: pg_sys::TimeLineID = 0;
    let flush = unsafe { pg_sys::GetFlushRecPtr(&mut timeline) };
    (flush, timeline)
}

/// `ReplicationSlotControlLock`, a macro over `MainLWLockArray` (index 37 in 15 to 18:
/// storage/lwlocknames.h).
pub fn replication_slot_control_lock() -> *mut pg_sys::LWLock {
    unsafe { std::ptr::addr_of_mut!((*pg_sys::MainLWLockArray.add(37)).lock) }
}

/// The buffer tag of a block address (`InitBufferTag()`, a static inline function).
#[cfg(feature = "pg15")]
pub fn buffer_tag(addr: &BlockAddress) -> pg_sys::BufferTag {
    pg_sys::BufferTag {
        rnode: pg_sys::RelFileNode {
            spcNode: pg_sys::Oid::from_u32(addr.spc),
            dbNode: pg_sys::Oid::from_u32(addr.db),
            relNode: pg_sys::Oid::from_u32(addr.rel),
        },
        forkNum: pg_sys::ForkNumber::Type::from(addr.fork),
        blockNum: addr.block,
    }
}

/// The buffer tag of a block address (`InitBufferTag()`, a static inline function).
#[cfg(not(feature = "pg15"))]
pub fn buffer_tag(addr: &BlockAddress) -> pg_sys::BufferTag {
    pg_sys::BufferTag {
        spcOid: pg_sys::Oid::from_u32(addr.spc),
        dbOid: pg_sys::Oid::from_u32(addr.db),
        relNumber: pg_sys::Oid::from_u32(addr.rel),
        forkNum: pg_sys::ForkNumber::Type::from(addr.fork),
        blockNum: addr.block,
    }
}

/// `BufMappingPartitionLock(hashcode)`, a macro over `MainLWLockArray`: the buffer mapping
/// partitions start at BUFFER_MAPPING_LWLOCK_OFFSET in 15 to 18 (storage/lwlock.h).
pub fn buffer_mapping_lock(hashcode: u32) -> *mut pg_sys::LWLock {
    let index = pg_sys::BUFFER_MAPPING_LWLOCK_OFFSET + hashcode % pg_sys::NUM_BUFFER_PARTITIONS;
    unsafe { std::ptr::addr_of_mut!((*pg_sys::MainLWLockArray.add(index as usize)).lock) }
}

/// The local transaction id a backend is in (`lxid`; `vxid.lxid` from 17 on), or
/// InvalidLocalTransactionId (0) between transactions.
///
/// # Safety
/// `proc_` points at a PGPROC in shared memory.
#[cfg(any(feature = "pg15", feature = "pg16"))]
pub unsafe fn local_transaction_id(proc_: *const pg_sys::PGPROC) -> u32 {
    unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*proc_).lxid)) }
}

/// The local transaction id a backend is in (`lxid`; `vxid.lxid` from 17 on), or
/// InvalidLocalTransactionId (0) between transactions.
///
/// # Safety
/// `proc_` points at a PGPROC in shared memory.
#[cfg(not(any(feature = "pg15", feature = "pg16")))]
pub unsafe fn local_transaction_id(proc_: *const pg_sys::PGPROC) -> u32 {
    unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*proc_).vxid.lxid)) }
}

/// `AddinShmemInitLock`, a macro over `MainLWLockArray` (index 21 in 15 to 18:
/// storage/lwlocknames.h), as pgrx's own shared memory initialization uses it.
pub fn addin_shmem_init_lock() -> *mut pg_sys::LWLock {
    unsafe { std::ptr::addr_of_mut!((*pg_sys::MainLWLockArray.add(21)).lock) }
}
