//! `aurora_ccm_status()`: Aurora's view of the CCM scans, column for column; and
//! `ccm_library_version()`, the version of the loaded library.
//!
//! "Current scan" is the scan in progress or, between scans, the one that just
//! completed; `current_scan_progress` counts the buffer headers it has visited.

use pgrx::prelude::*;

use crate::errors;
use crate::shmem;

fn as_int8(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[pg_extern(volatile, parallel_safe)]
fn aurora_ccm_status() -> TableIterator<
    'static,
    (
        name!(buffers_sent_last_minute, i64),
        name!(buffers_found_last_minute, i64),
        name!(buffers_sent_last_scan, i64),
        name!(buffers_found_last_scan, i64),
        name!(buffers_sent_current_scan, i64),
        name!(buffers_found_current_scan, i64),
        name!(current_scan_progress, i64),
    ),
> {
    errors::require_enabled();
    let status = shmem::snapshot();
    TableIterator::once((
        as_int8(status.last_minute.sent),
        as_int8(status.last_minute.found),
        as_int8(status.last_scan.sent),
        as_int8(status.last_scan.found),
        as_int8(status.current_scan.sent),
        as_int8(status.current_scan.found),
        as_int8(status.current_scan_progress),
    ))
}

/// The version of the pg_ccm library this server has loaded, which can differ from the
/// catalog's (`pg_extension.extversion`) during a rolling upgrade. The same as
/// `current_setting('ccm.library_version')`, which also answers under older catalogs.
#[pg_extern(stable, parallel_safe)]
fn ccm_library_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}
