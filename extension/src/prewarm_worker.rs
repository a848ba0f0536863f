//! ccm_prewarm()'s blocks of other databases, read by a background worker connected to each
//! such database, as autoprewarm does (autoprewarm.c: apw_start_database_worker and
//! autoprewarm_database_main). Relation OIDs, and with them the relation locks that keep
//! replay and our reads apart, exist only inside one database.
//!
//! The caller copies the block list into a dynamic shared memory segment, starts the
//! worker and waits for it. The worker reads its database's blocks with the same locked
//! reads as the caller (prewarm.rs) and writes its counts, or the ERROR that stopped it,
//! back into the segment; the caller raises that ERROR with its SQLSTATE, so a recovery
//! conflict in a worker looks to the agent like one in the caller. Whenever the caller
//! detaches from the segment before the worker is done (an ERROR, a cancel, FATAL), a
//! detach callback terminates the worker, so it never reads for nobody. A database that
//! does not exist or takes no connections (template0, or one left invalid by an interrupted
//! DROP DATABASE), a worker that cannot start (max_worker_processes) and a worker that
//! exits without finishing (its database dropped or moved by replay, which terminates
//! every session of it, or a shutdown) leave their blocks skipped, the last two with a
//! WARNING.

use std::sync::atomic::{AtomicU32, Ordering};

use ccm_codec::BlockList;
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::pg_sys::panic::CaughtError;
use pgrx::prelude::*;
use pgrx::PgMemoryContexts;
use pgrx::PgSqlErrorCode;

use crate::compat;
use crate::errors;
use crate::prewarm::{self, Outcome};

/// Room for the worker's error message.
const MESSAGE_BYTES: usize = 512;

/// "CCMW": the segment is one of ours.
const MAGIC: u32 = 0x4343_4d57;

const RUNNING: u32 = 0;
const DONE: u32 = 1;
const FAILED: u32 = 2;
/// The worker left (FATAL, SIGTERM) without an answer.
const EXITED: u32 = 3;

/// The segment's header; the list's bytes follow it.
#[repr(C)]
struct Shared {
    magic: u32,
    database: u32,
    state: AtomicU32,
    /// PostgreSQL's packed SQLSTATE of the worker's ERROR (FAILED).
    sqlstate: i32,
    message_len: u32,
    message: [u8; MESSAGE_BYTES],
    list_len: u64,
    outcome: Outcome,
}

unsafe extern "C-unwind" {
    /// postgres.c's SIGTERM handler of backends, as autoprewarm's workers install it: the
    /// worker leaves at its next CHECK_FOR_INTERRUPTS(). Not the pgrx wrapper of `die`,
    /// which is no signal handler.
    #[link_name = "die"]
    fn backend_die(signal: std::ffi::c_int);
}

/// The databases other than `here` (and the shared catalogs, 0) that own blocks of the
/// list, each with its number of blocks, in list order.
pub(crate) fn other_databases(list: &BlockList, here: u32) -> Vec<(u32, u64)> {
    let mut databases: Vec<(u32, u64)> = Vec::new();
    for group in list.groups.iter().filter(|group| group.rel.db != 0 && group.rel.db != here) {
        let blocks = group.blocks.len() as u64;
        match databases.iter_mut().find(|(db, _)| *db == group.rel.db) {
            Some((_, count)) => *count += blocks,
            None => databases.push((group.rel.db, blocks)),
        }
    }
    databases
}

/// Whether database `db` exists, and if so whether it takes connections (not template0,
/// not left invalid by an interrupted DROP DATABASE).
fn database_accepts_connections(db: u32) -> Option<bool> {
    unsafe {
        let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::DATABASEOID as i32, pg_sys::Datum::from(db));
        if tuple.is_null() {
            return None;
        }
        let form = pg_sys::GETSTRUCT(tuple) as *const pg_sys::FormData_pg_database;
        let allowed = (*form).datallowconn && (*form).datconnlimit != pg_sys::DATCONNLIMIT_INVALID_DB;
        pg_sys::ReleaseSysCache(tuple);
        Some(allowed)
    }
}

/// Caller's detach callback: the caller is leaving (or done), so the worker must not go on.
#[pg_guard]
unsafe extern "C-unwind" fn terminate_worker(_segment: *mut pg_sys::dsm_segment, handle: pg_sys::Datum) {
    unsafe { pg_sys::TerminateBackgroundWorker(handle.cast_mut_ptr::<pg_sys::BackgroundWorkerHandle>()) };
}

/// Worker's detach callback (it runs at exit too): an unanswered request becomes EXITED.
#[pg_guard]
unsafe extern "C-unwind" fn mark_exited(_segment: *mut pg_sys::dsm_segment, shared: pg_sys::Datum) {
    let shared = shared.cast_mut_ptr::<Shared>();
    let _ = unsafe { &(*shared).state }.compare_exchange(RUNNING, EXITED, Ordering::AcqRel, Ordering::Acquire);
}

/// Starts the worker; its handle, or None when no worker slot is free.
///
/// The handle is allocated in TopTransactionContext, as parallel.c allocates its workers'
/// handles (and src/test/modules/test_shm_mq/setup.c explains): the detach callback that
/// terminates the worker reads it while AbortTransaction releases the resource owner, after
/// AtAbort_Portals may have deleted the memory of the portal running this call (on FATAL it
/// does). TopTransactionContext lives until CleanupTransaction, after the callbacks; the
/// caller frees the handle when it is done with it.
fn register_worker(builder: &BackgroundWorkerBuilder) -> Option<*mut pg_sys::BackgroundWorkerHandle> {
    let mut worker: pg_sys::BackgroundWorker = builder.into();
    let mut handle: *mut pg_sys::BackgroundWorkerHandle = std::ptr::null_mut();
    let registered = unsafe {
        PgMemoryContexts::TopTransactionContext
            .switch_to(|_| pg_sys::RegisterDynamicBackgroundWorker(&mut worker, &mut handle))
    };
    registered.then_some(handle)
}

/// Reads the `blocks` blocks of database `db` named in `list` (the encoded list) through a
/// worker connected to it, and returns what happened to them.
pub(crate) fn prewarm_database(db: u32, blocks: u64, list: &[u8]) -> Outcome {
    let skipped = |unknown: bool| {
        let mut outcome = Outcome::default();
        if unknown {
            outcome.skipped_unknown_database = blocks;
        } else {
            outcome.skipped_other_database = blocks;
        }
        outcome
    };
    match database_accepts_connections(db) {
        None => return skipped(true),
        Some(false) => return skipped(false),
        Some(true) => {}
    }

    let size = std::mem::size_of::<Shared>() + list.len();
    // Raises an ERROR ("out of shared memory" or similar) when no segment can be had.
    let segment = unsafe { pg_sys::dsm_create(size, 0) };
    let shared = unsafe { pg_sys::dsm_segment_address(segment) } as *mut Shared;
    unsafe {
        std::ptr::write_bytes(shared.cast::<u8>(), 0, std::mem::size_of::<Shared>());
        (*shared).magic = MAGIC;
        (*shared).database = db;
        (*shared).state = AtomicU32::new(RUNNING);
        (*shared).list_len = list.len() as u64;
        std::ptr::copy_nonoverlapping(list.as_ptr(), shared.add(1).cast::<u8>(), list.len());
    }

    let builder = BackgroundWorkerBuilder::new(&format!("pg_ccm prewarm of database {db}"))
        .set_type("pg_ccm prewarm")
        .set_library("pg_ccm")
        .set_function("ccm_prewarm_worker_main")
        .enable_spi_access()
        // After enable_spi_access(), which would make it wait for the end of recovery.
        .set_start_time(BgWorkerStartTime::ConsistentState)
        .set_restart_time(None)
        .set_argument(Some(pg_sys::Datum::from(unsafe { pg_sys::dsm_segment_handle(segment) })))
        .set_notify_pid(unsafe { pg_sys::MyProcPid });
    let Some(handle) = register_worker(&builder) else {
        unsafe { pg_sys::dsm_detach(segment) };
        warning!(
            "pg_ccm: could not start a prewarm worker for database {db}; {blocks} blocks of it are skipped (consider increasing max_worker_processes)"
        );
        return skipped(false);
    };

    // Whatever ends our part in this (an ERROR or cancel while we wait, which detaches the
    // segment through the resource owner, or FATAL), the worker is terminated with it.
    let callback_arg = pg_sys::Datum::from(handle);
    unsafe { pg_sys::on_dsm_detach(segment, Some(terminate_worker), callback_arg) };
    let status = unsafe { pg_sys::WaitForBackgroundWorkerShutdown(handle) };
    unsafe {
        pg_sys::cancel_on_dsm_detach(segment, Some(terminate_worker), callback_arg);
        pg_sys::pfree(handle.cast());
    }
    if status == pg_sys::BgwHandleStatus::BGWH_POSTMASTER_DIED {
        errors::raise(
            PgSqlErrorCode::ERRCODE_ADMIN_SHUTDOWN,
            "postmaster exited while ccm_prewarm() waited for its worker".into(),
            None,
            None,
        );
    }

    let state = unsafe { (*shared).state.load(Ordering::Acquire) };
    let outcome = unsafe { (*shared).outcome };
    let failure = (state == FAILED).then(|| unsafe {
        let message = &*std::ptr::addr_of!((*shared).message);
        let message = &message[..((*shared).message_len as usize).min(MESSAGE_BYTES)];
        ((*shared).sqlstate, String::from_utf8_lossy(message).into_owned())
    });
    unsafe { pg_sys::dsm_detach(segment) };
    match (state, failure) {
        (DONE, _) => outcome,
        (_, Some((sqlstate, message))) => errors::raise(
            PgSqlErrorCode::from(sqlstate),
            message,
            Some(format!("Raised by the pg_ccm prewarm worker of database {db}.")),
            None,
        ),
        // It left without an answer: replay dropped or moved its database (and terminated
        // its sessions), or a shutdown. Its blocks are skipped, as for any gone database.
        _ => {
            unsafe { pg_sys::AcceptInvalidationMessages() };
            let gone = database_accepts_connections(db).is_none();
            if !gone {
                warning!(
                    "pg_ccm: the prewarm worker of database {db} exited before finishing; {blocks} blocks of it are skipped"
                );
            }
            skipped(gone)
        }
    }
}

fn record_failure(shared: *mut Shared, error: &CaughtError) {
    let (code, message) = match error {
        CaughtError::PostgresError(report) | CaughtError::ErrorReport(report) => {
            (report.sql_error_code(), report.message().to_string())
        }
        CaughtError::RustPanic { ereport, .. } => (ereport.sql_error_code(), ereport.message().to_string()),
    };
    let bytes = message.as_bytes();
    let len = bytes.len().min(MESSAGE_BYTES);
    unsafe {
        (*shared).sqlstate = code as i32;
        (&mut *std::ptr::addr_of_mut!((*shared).message))[..len].copy_from_slice(&bytes[..len]);
        (*shared).message_len = len as u32;
        (*shared).state.store(FAILED, Ordering::Release);
    }
}

/// Main function of a prewarm worker: the argument is the handle of the caller's segment.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn ccm_prewarm_worker_main(argument: pg_sys::Datum) {
    unsafe {
        compat::set_signal_handler(libc::SIGTERM, backend_die);
        pg_sys::BackgroundWorkerUnblockSignals();
    }
    let segment = unsafe { pg_sys::dsm_attach(argument.value() as pg_sys::dsm_handle) };
    if segment.is_null() {
        errors::raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "could not map dynamic shared memory segment".into(),
            None,
            None,
        );
    }
    let shared = unsafe { pg_sys::dsm_segment_address(segment) } as *mut Shared;
    let mapped = unsafe { pg_sys::dsm_segment_map_length(segment) };
    let header = std::mem::size_of::<Shared>();
    let fits = mapped >= header
        && unsafe { (*shared).magic } == MAGIC
        && unsafe { (*shared).list_len }.checked_add(header as u64).is_some_and(|end| end <= mapped as u64);
    if !fits {
        errors::raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "dynamic shared memory segment is not a pg_ccm prewarm request".into(),
            None,
            None,
        );
    }
    // Exiting without an answer (FATAL, SIGTERM) still tells the caller.
    unsafe { pg_sys::on_dsm_detach(segment, Some(mark_exited), pg_sys::Datum::from(shared)) };
    let db = unsafe { (*shared).database };
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from_u32(db)), None);
    let bytes = unsafe { std::slice::from_raw_parts(shared.add(1).cast::<u8>(), (*shared).list_len as usize) };

    let outcome = PgTryBuilder::new(|| unsafe {
        pg_sys::StartTransactionCommand();
        let list = prewarm::decode(bytes);
        let outcome = prewarm::read_blocks(&list, |group_db| group_db == db);
        pg_sys::CommitTransactionCommand();
        outcome
    })
    .catch_others(|error| {
        record_failure(shared, &error);
        error.rethrow()
    })
    .execute();

    unsafe {
        (*shared).outcome = outcome;
        (*shared).state.store(DONE, Ordering::Release);
        pg_sys::dsm_detach(segment);
    }
}
