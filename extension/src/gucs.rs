//! Configuration parameters (all under the reserved `ccm.` prefix).

use pgrx::{pg_guard, pg_sys, GucContext, GucFlags, GucRegistry, GucSetting};

/// `ccm.enabled`: the analog of Aurora's `apg_ccm_enabled`. When off, the CCM functions
/// raise "Cluster Cache Manager is disabled" and the agent idles.
pub static ENABLED: GucSetting<bool> = GucSetting::<bool>::new(true);

/// `ccm.usage_threshold`: a buffer is hot when its usage count is greater than this.
pub static USAGE_THRESHOLD: GucSetting<i32> = GucSetting::<i32>::new(3);

/// `ccm.prewarm_readahead_threads`: threads that advise the kernel of `ccm_prewarm`'s
/// upcoming reads; 0 leaves the advice to the backend itself.
pub static PREWARM_READAHEAD_THREADS: GucSetting<i32> = GucSetting::<i32>::new(2);

/// `ccm.os_cache_min_free`: megabytes of memory `ccm_os_prefetch` leaves free on a standby.
pub static OS_CACHE_MIN_FREE: GucSetting<i32> = GucSetting::<i32>::new(1024);

/// `ccm.os_cache_release_wal`: whether a node drops the WAL every reader has passed from its
/// page cache (`wal_release.rs`); read at server start, when the worker that does it is
/// registered.
pub static OS_CACHE_RELEASE_WAL: GucSetting<bool> = GucSetting::<bool>::new(true);

/// `ccm.logical_wal_cache`: size of the logical WAL cache in WAL pages (8 kB); 0 turns it
/// off, 1 to 3 are raised to 4 (as Aurora's `rds.logical_wal_cache`). The worker uses at
/// most a quarter of the server's memory (RAM, or a cgroup's limit if smaller), whatever the
/// setting (`wal_cache::cache_pages`).
pub static LOGICAL_WAL_CACHE: GucSetting<i32> = GucSetting::<i32>::new(2048);

/// 32 GB of WAL; more is a typo rather than a cache. (The worker also caps the cache at a
/// quarter of the server's memory.)
const MAX_LOGICAL_WAL_CACHE: i32 = 4 * 1024 * 1024;

/// Raises positive settings below the minimum, so that SHOW reports the size in use.
#[pg_guard]
unsafe extern "C-unwind" fn check_logical_wal_cache(
    new_value: *mut std::ffi::c_int,
    _extra: *mut *mut std::ffi::c_void,
    _source: pg_sys::GucSource::Type,
) -> bool {
    unsafe { *new_value = ccm_walcache::effective_cache_pages(*new_value) };
    true
}

/// This library's version, NUL-terminated for the GUC below.
const LIBRARY_VERSION: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes(),
) {
    Ok(version) => version,
    Err(_) => panic!("CARGO_PKG_VERSION holds a NUL byte"),
};

/// `ccm.library_version`: the version of the pg_ccm library this server has loaded, read-only
/// (PGC_INTERNAL, as server_version). It exists whatever the catalog says, so that the agent
/// can tell a library older than the catalog from the catalog itself: a library from before
/// 0.7.0 does not define it, and `current_setting('ccm.library_version', true)` is NULL there.
pub static LIBRARY_VERSION_SETTING: GucSetting<Option<std::ffi::CString>> =
    GucSetting::<Option<std::ffi::CString>>::new(Some(LIBRARY_VERSION));

/// Largest useful threshold: BM_MAX_USAGE_COUNT is 5, so 4 still leaves a hot set.
pub const MAX_USAGE_THRESHOLD: i32 = 4;

pub fn init() {
    GucRegistry::define_bool_guc(
        c"ccm.enabled",
        c"Enables cluster cache management.",
        c"When off, aurora_ccm_status() and the block transfer functions raise an error and ccm-agent stops warming the standby.",
        &ENABLED,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"ccm.usage_threshold",
        c"Buffers whose usage count is greater than this are sent to the standby.",
        c"The usage count is the clock-sweep counter of a buffer (0 to 5).",
        &USAGE_THRESHOLD,
        0,
        MAX_USAGE_THRESHOLD,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"ccm.prewarm_readahead_threads",
        c"Threads that issue ccm_prewarm()'s read-ahead advice.",
        c"ccm_prewarm() starts this many threads that call posix_fadvise(WILLNEED) for upcoming blocks, so that the reads overlap; 0 issues the advice from the backend itself.",
        &PREWARM_READAHEAD_THREADS,
        0,
        16,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"ccm.os_cache_min_free",
        c"Memory ccm_os_prefetch() leaves free on a standby.",
        c"ccm_os_prefetch() reads into the page cache only while more than this is free (MemFree, or the cgroup's memory limit less its usage), so it never evicts what the standby's own readers cached.",
        &OS_CACHE_MIN_FREE,
        0,
        i32::MAX / 2,
        GucContext::Sighup,
        GucFlags::UNIT_MB,
    );
    GucRegistry::define_bool_guc(
        c"ccm.os_cache_release_wal",
        c"Drops WAL that every reader has passed from the page cache.",
        c"Once replayed (a standby) or flushed, sent to every walsender, past every logical slot's restart_lsn and the logical WAL cache's window, and archived, WAL is read by nobody soon; dropping it (posix_fadvise DONTNEED) leaves that memory to relation pages instead of evicting them.",
        &OS_CACHE_RELEASE_WAL,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    // SAFETY: the check hook is guarded and only rewrites the proposed value.
    unsafe {
        GucRegistry::define_int_guc_with_hooks(
            c"ccm.logical_wal_cache",
            c"Size of the logical replication WAL cache.",
            c"The newest WAL pages, up to this size, are kept in memory for logical walsenders; 0 turns the cache off, sizes below 4 pages are raised to 4, and at most a quarter of the server's memory (RAM, or its cgroup's memory limit if smaller) is used.",
            &LOGICAL_WAL_CACHE,
            0,
            MAX_LOGICAL_WAL_CACHE,
            GucContext::Postmaster,
            GucFlags::UNIT_XBLOCKS,
            Some(check_logical_wal_cache),
            None,
            None,
        );
    }
    GucRegistry::define_string_guc(
        c"ccm.library_version",
        c"Shows the version of the loaded pg_ccm library.",
        c"The extension's catalog (pg_extension.extversion) can differ from the library during a rolling upgrade.",
        &LIBRARY_VERSION_SETTING,
        GucContext::Internal,
        GucFlags::DISALLOW_IN_FILE,
    );
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"ccm".as_ptr()) };
}
