//! Keeps the newest WAL pages in memory by mapping the segment files and locking the pages.
//!
//! PostgreSQL has no hook in the walsender's WAL reads: `WALRead()` calls `pread()` on the
//! segment files in `pg_wal`, which the kernel serves from its page cache when the pages are
//! there. So the cache keeps *those* pages there: each segment touching the window is mapped
//! read-only (`MAP_SHARED`, so the mapping is the page cache itself), and the window's pages
//! are locked with `mlock()`, which makes them unevictable until unlocked. As the flush
//! position moves, new pages are locked as they are written and the oldest unlocked, first in
//! first out. Nothing is copied and nothing is written.
//!
//! **The mapping is never read.** An I/O error on a mapped file page is a SIGBUS for the
//! process that touches it, and a signal death of a shared-memory-attached worker makes the
//! postmaster restart the whole instance. So the mapping serves only as the address range
//! that `mlock`, `munlock` and `mincore` work on, and none of them raises a signal: `mlock`
//! faults the pages in through get_user_pages, which turns a failed read (VM_FAULT_SIGBUS)
//! into EFAULT, reported by `mlock` as ENOMEM (mm/gup.c `vm_fault_to_errno`, mm/mlock.c
//! `__mlock_posix_error_return`); `munlock` and `mincore` read nothing. Where the cache wants a
//! page read, it reads it with `pread()`, which reports EIO as an errno.
//!
//! **Locking is incremental.** `mlock()` populates the range: it reads non-resident pages
//! from storage, synchronously and without looking at signals other than SIGKILL. At worker
//! start, after a timeline switch, or after a burst of WAL the range to lock can be the whole
//! cache. So it is locked in steps of `LOCK_STEP` (newest first), for at most
//! `LOCK_TIME_PER_TICK` per tick, and the caller's `stop` is asked between steps, so that
//! SIGTERM and postmaster death are noticed after one step at most.
//!
//! **OS pages.** `mlock`/`munlock` act on whole OS pages and `mincore` wants an OS-page-aligned
//! address; with 64 kB pages (some aarch64 kernels) an 8 kB-aligned range would lock or unlock
//! neighbouring pages. Every range passed to them is aligned to the lock granule (the OS page,
//! at least a WAL page; `ccm_walcache::lock_granule`).
//!
//! `mlock()` is limited by RLIMIT_MEMLOCK (8 MB for an ordinary user on Debian). The worker
//! raises its soft limit to the hard one and locks the newest pages that fit; the older rest
//! of the window stays mapped: every 100 ms the worker checks which of its pages are resident
//! (`mincore`), and once a second it reads one byte of each of the newest resident ones with
//! `pread()`, which marks them recently used so the kernel evicts other pages first (but may
//! still evict them). Pages found evicted are not read back: the window is reported as held
//! only from the newest evicted page on. A failed `mlock` (EAGAIN under memory pressure, say)
//! is retried later, with a backoff from 1 s to a minute.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use ccm_walcache::{
    align_down, align_up, held_start, lock_retry_delay_ms, lock_target, next_lock_step,
    segment_pieces, segments_of, wal_file_name, widen, Window, WAL_PAGE,
};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

/// How often residency of the unlocked part is checked, and mapped files re-identified.
const RESIDENCY_CHECK: Duration = Duration::from_millis(100);
/// How often the residency check also reads the resident unlocked pages: once a second
/// keeps them recently used (a read moves a page to the kernel's active list) at a tenth of
/// the system calls of reading them on every check.
const TOUCH_INTERVAL: Duration = Duration::from_secs(1);
const IDENTITY_CHECK: Duration = Duration::from_secs(1);
/// Bytes locked by one `mlock()` call: a few milliseconds of reading from a local disk, a
/// fraction of a second from slow storage (4 MB at 20 MB/s is 0.2 s), which bounds how long
/// SIGTERM waits.
const LOCK_STEP: u64 = 4 * 1024 * 1024;
/// Time a tick may spend locking before it accounts and publishes again.
const LOCK_TIME_PER_TICK: Duration = Duration::from_millis(50);
/// OS pages per `mincore()` call of a residency check.
const RESIDENCY_CHUNK: u64 = 4096;
/// OS pages read (to mark them recently used) per residency check, newest first: 32 MB of
/// 4 kB pages, a few milliseconds of `pread` calls.
const MAX_TOUCHES_PER_CHECK: usize = 8192;
/// At most one WARNING per this interval for failed reads of the unlocked part.
const READ_ERROR_REPORT_INTERVAL: Duration = Duration::from_secs(60);

/// The OS page size.
pub fn os_page_size() -> u64 {
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as u64
    } else {
        4096
    }
}

/// An OS error as PostgreSQL's `%m` prints it (without Rust's " (os error N)").
fn os_error_text(error: &std::io::Error) -> String {
    let text = error.to_string();
    match text.rfind(" (os error ") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

fn report(level: PgLogLevel, message: String, detail: Option<String>) {
    let mut report = ErrorReport::new(
        PgSqlErrorCode::ERRCODE_INSUFFICIENT_RESOURCES,
        message,
        "pg_ccm",
    );
    if let Some(detail) = detail {
        report = report.set_detail(detail);
    }
    report.report(level);
}

/// One segment file mapped in full. The mapping is an address range for `mlock`, `munlock`
/// and `mincore` only: nothing dereferences `address` (see the module comment).
struct MappedSegment {
    address: *mut u8,
    length: usize,
    /// (device, inode) of the file when mapped: a recycled segment is renamed, so the name
    /// then points to another file.
    identity: (u64, u64),
}

impl MappedSegment {
    fn open(path: &str, segment_size: u64) -> Option<MappedSegment> {
        let file = File::open(path).ok()?;
        let metadata = file.metadata().ok()?;
        // Pages past the end of a short file could not be locked (mlock would fail).
        if metadata.len() != segment_size {
            return None;
        }
        let length = segment_size as usize;
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return None;
        }
        // The mapping keeps the file; the descriptor can go.
        Some(MappedSegment {
            address: address.cast(),
            length,
            identity: (metadata.dev(), metadata.ino()),
        })
    }

    fn range(&self, offsets: &std::ops::Range<u64>) -> (*mut libc::c_void, usize) {
        assert!(offsets.start <= offsets.end && offsets.end <= self.length as u64);
        (
            // SAFETY: within the mapping (asserted); the pointer is only passed to system calls.
            unsafe { self.address.add(offsets.start as usize) }.cast(),
            (offsets.end - offsets.start) as usize,
        )
    }

    /// Locks (and so reads in) a granule-aligned range. On failure the range is unlocked
    /// again: the kernel marks the range locked before it populates it, so a failed
    /// population would leave pages counted against RLIMIT_MEMLOCK that the cache does not
    /// count as locked.
    fn lock(&self, offsets: &std::ops::Range<u64>) -> std::io::Result<()> {
        let (address, length) = self.range(offsets);
        if unsafe { libc::mlock(address, length) } == 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        unsafe { libc::munlock(address, length) };
        Err(error)
    }

    /// Unlocks a granule-aligned range (whole OS pages, so no neighbour is unlocked).
    fn unlock(&self, offsets: &std::ops::Range<u64>) {
        let (address, length) = self.range(offsets);
        unsafe { libc::munlock(address, length) };
    }

    /// Page-cache residency of the OS pages of a range whose start is OS-page-aligned: one
    /// byte per page, bit 0 set when resident. False when `mincore` fails.
    fn residency(&self, offsets: &std::ops::Range<u64>, os_page: u64, out: &mut Vec<u8>) -> bool {
        debug_assert_eq!(offsets.start % os_page, 0);
        let (address, length) = self.range(offsets);
        out.clear();
        out.resize((length as u64).div_ceil(os_page) as usize, 0);
        unsafe { libc::mincore(address, length, out.as_mut_ptr()) == 0 }
    }
}

impl Drop for MappedSegment {
    fn drop(&mut self) {
        // Unmapping also unlocks.
        unsafe { libc::munmap(self.address.cast(), self.length) };
    }
}

/// Marks resident pages of one segment file as recently used by reading one byte of each
/// into a stack buffer with `pread()`, instead of touching the mapping: a read error is an
/// errno (EIO), never a signal. (`posix_fadvise(WILLNEED)` would not do: it starts reads of
/// evicted pages and leaves resident ones alone, without marking them accessed.) The file
/// is opened afresh and must be the mapped one; readahead is off (POSIX_FADV_RANDOM) and the
/// reads use RWF_NOWAIT where the file system supports it, so that a page evicted since
/// `mincore` saw it is not read back from storage.
struct Toucher {
    file: File,
}

impl Toucher {
    fn open(path: &str, identity: (u64, u64)) -> Option<Toucher> {
        let file = File::open(path).ok()?;
        let metadata = file.metadata().ok()?;
        if (metadata.dev(), metadata.ino()) != identity {
            return None; // recycled since mapped: the identity check will drop the mapping
        }
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
        Some(Toucher { file })
    }

    /// Reads the byte at `offset`. A page that is not in memory (or is locked by a writer)
    /// is skipped under RWF_NOWAIT (EAGAIN); `nowait` is cleared for good where the kernel
    /// or file system does not support it.
    fn touch(&self, offset: u64, nowait: &mut bool) -> std::io::Result<()> {
        let mut byte = [0u8; 1];
        let fd = self.file.as_raw_fd();
        if *nowait {
            let iov = libc::iovec {
                iov_base: byte.as_mut_ptr().cast(),
                iov_len: 1,
            };
            if unsafe { libc::preadv2(fd, &iov, 1, offset as libc::off_t, libc::RWF_NOWAIT) } >= 0 {
                return Ok(());
            }
            let error = std::io::Error::last_os_error();
            match error.raw_os_error() {
                Some(libc::EAGAIN | libc::EINTR) => return Ok(()),
                Some(libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS) => *nowait = false,
                _ => return Err(error),
            }
        }
        if unsafe { libc::pread(fd, byte.as_mut_ptr().cast(), 1, offset as libc::off_t) } >= 0 {
            Ok(())
        } else {
            let error = std::io::Error::last_os_error();
            match error.raw_os_error() {
                Some(libc::EINTR) => Ok(()),
                _ => Err(error),
            }
        }
    }
}

/// The lock budget: unlimited with CAP_IPC_LOCK, else RLIMIT_MEMLOCK after raising the
/// soft limit to the hard one.
pub fn raise_lock_limit() -> u64 {
    if has_ipc_lock_capability() {
        return u64::MAX;
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe {
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) != 0 {
            return 0;
        }
        if limit.rlim_cur != limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &raised) == 0 {
                limit = raised;
            }
        }
    }
    if limit.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        limit.rlim_cur
    }
}

/// Whether this process may lock memory beyond RLIMIT_MEMLOCK: `mlock()` ignores the limit
/// for a process with CAP_IPC_LOCK in its effective set (systemd's AmbientCapabilities).
fn has_ipc_lock_capability() -> bool {
    const CAP_IPC_LOCK: u32 = 14; // linux/capability.h
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << CAP_IPC_LOCK) != 0)
}

/// What the cache covers after a step.
#[derive(Clone, Copy, Debug, Default)]
pub struct Coverage {
    pub held: Window,
    pub locked: Window,
}

fn segment_path(timeline: u32, segno: u64, segment_size: u64) -> String {
    format!("pg_wal/{}", wal_file_name(timeline, segno, segment_size))
}

pub struct SegmentCache {
    pages: u64,
    segment_size: u64,
    os_page: u64,
    /// Unit of locking (see `ccm_walcache::lock_granule`).
    granule: u64,
    lock_budget: u64,
    lock_step: u64,
    timeline: u32,
    segments: BTreeMap<u64, MappedSegment>,
    /// What is locked: a contiguous, granule-aligned range of LSNs within the lock target.
    locked: Window,
    /// Failed `mlock` calls in a row (reset once the target is fully locked), and when to
    /// try again.
    lock_failures: u32,
    lock_retry_at: Option<Instant>,
    /// Start of the held window as of the last residency check of the unlocked part.
    resident_from: u64,
    last_residency_check: Option<Instant>,
    last_touch: Option<Instant>,
    last_identity_check: Instant,
    /// Whether `preadv2(RWF_NOWAIT)` works here.
    read_nowait: bool,
    last_read_error_report: Option<Instant>,
    residency: Vec<u8>,
}

impl SegmentCache {
    /// `granule`: see `ccm_walcache::lock_granule`; None makes the cache map only.
    pub fn new(
        pages: u64,
        segment_size: u64,
        lock_budget: u64,
        os_page: u64,
        granule: Option<u64>,
    ) -> SegmentCache {
        let (granule, lock_budget) = match granule {
            Some(granule) => (granule, lock_budget),
            None => (os_page.max(WAL_PAGE).next_power_of_two(), 0),
        };
        SegmentCache {
            pages,
            segment_size,
            os_page,
            granule,
            lock_budget,
            lock_step: align_up(LOCK_STEP, granule),
            timeline: 0,
            segments: BTreeMap::new(),
            locked: Window::EMPTY,
            lock_failures: 0,
            lock_retry_at: None,
            resident_from: 0,
            last_residency_check: None,
            last_touch: None,
            last_identity_check: Instant::now(),
            read_nowait: true,
            last_read_error_report: None,
            residency: Vec::new(),
        }
    }

    fn path(&self, segno: u64) -> String {
        segment_path(self.timeline, segno, self.segment_size)
    }

    /// Lets go of everything (unmapping unlocks).
    pub fn release(&mut self) {
        self.segments.clear();
        self.locked = Window::EMPTY;
        self.last_residency_check = None;
    }

    /// Moves the cache to the newest pages behind `flush`, on `timeline`. Locking what is
    /// not locked yet takes at most about LOCK_TIME_PER_TICK plus one step, and stops as soon
    /// as `stop()` says so; the next call goes on.
    pub fn advance(&mut self, flush: u64, timeline: u32, stop: &dyn Fn() -> bool) -> Coverage {
        if timeline != self.timeline {
            // Segment names carry the timeline; after a promotion start over on the new one.
            self.release();
            self.timeline = timeline;
        }
        let window = Window::newest(flush, self.pages);
        let wanted = segments_of(window, self.segment_size);
        self.forget_recycled_segments();
        self.segments.retain(|segno, _| wanted.contains(segno));
        for segno in wanted.clone() {
            if !self.segments.contains_key(&segno) {
                if let Some(mapped) = MappedSegment::open(&self.path(segno), self.segment_size) {
                    self.segments.insert(segno, mapped);
                }
            }
        }
        // The cache holds at most the newest run of segments it could map.
        let mut first_mapped = wanted.end;
        while first_mapped > wanted.start && self.segments.contains_key(&(first_mapped - 1)) {
            first_mapped -= 1;
        }
        let mapped = window.starting_at_or_after(first_mapped * self.segment_size);
        let target = lock_target(mapped, self.lock_budget, self.granule);
        self.unlock_outside(target);
        self.lock_steps(target, stop);
        let held = self.resident_part(mapped, target);
        Coverage {
            held,
            locked: mapped.intersect(&self.locked).intersect(&held),
        }
    }

    fn forget_recycled_segments(&mut self) {
        if self.last_identity_check.elapsed() < IDENTITY_CHECK {
            return;
        }
        self.last_identity_check = Instant::now();
        let stale: Vec<u64> = self
            .segments
            .iter()
            .filter(|(segno, mapped)| {
                std::fs::metadata(self.path(**segno))
                    .map(|m| (m.dev(), m.ino()) != mapped.identity)
                    .unwrap_or(true)
            })
            .map(|(segno, _)| *segno)
            .collect();
        for segno in stale {
            let segment_range = Window {
                start: segno * self.segment_size,
                end: (segno + 1) * self.segment_size,
            };
            if !self.locked.intersect(&segment_range).is_empty() {
                // The locked range must stay contiguous: start over (unmapping the segment
                // unlocks its part).
                self.unlock_outside(Window::EMPTY);
            }
            self.segments.remove(&segno);
        }
    }

    /// Unlocks what is locked outside `target`; both are granule-aligned, so exactly the
    /// pages that leave are unlocked.
    fn unlock_outside(&mut self, target: Window) {
        for range in self.locked.minus(&target) {
            for piece in segment_pieces(range, self.segment_size) {
                if let Some(segment) = self.segments.get(&piece.segno) {
                    segment.unlock(&piece.offsets);
                }
            }
        }
        self.locked = self.locked.intersect(&target);
    }

    /// Locks `target` step by step, newest first, within this tick's time and while `stop()`
    /// is false; waits out the backoff after a failure.
    fn lock_steps(&mut self, target: Window, stop: &dyn Fn() -> bool) {
        if self.lock_retry_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let deadline = Instant::now() + LOCK_TIME_PER_TICK;
        loop {
            let Some(range) =
                next_lock_step(self.locked, target, self.lock_step, self.segment_size)
            else {
                if self.lock_failures > 0 {
                    pgrx::log!("pg_ccm logical WAL cache pages are locked in memory again");
                }
                self.lock_failures = 0;
                self.lock_retry_at = None;
                return;
            };
            if stop() || Instant::now() >= deadline {
                return;
            }
            // A step lies within one segment, and the target within the mapped segments.
            let segno = range.start / self.segment_size;
            let Some(segment) = self.segments.get(&segno) else {
                return;
            };
            let base = segno * self.segment_size;
            if let Err(error) = segment.lock(&(range.start - base..range.end - base)) {
                self.lock_failed(&error);
                return;
            }
            self.locked = widen(self.locked, range);
        }
    }

    fn lock_failed(&mut self, error: &std::io::Error) {
        self.lock_failures = self.lock_failures.saturating_add(1);
        let delay = lock_retry_delay_ms(self.lock_failures);
        self.lock_retry_at = Some(Instant::now() + Duration::from_millis(delay));
        let level = if self.lock_failures == 1 {
            PgLogLevel::WARNING
        } else {
            PgLogLevel::DEBUG1
        };
        report(
            level,
            format!(
                "pg_ccm could not lock logical WAL cache pages in memory: {}",
                os_error_text(error)
            ),
            Some(format!(
                "Locking is retried in {} s; meanwhile the pages not locked are only mapped.",
                delay / 1000
            )),
        );
    }

    /// The part of `mapped` in memory: from just after the newest page not locked and found
    /// evicted by the last residency check (every RESIDENCY_CHECK), with what has been
    /// locked since counted as held.
    fn resident_part(&mut self, mapped: Window, target: Window) -> Window {
        if mapped.is_empty() {
            return Window::EMPTY;
        }
        let span = Window {
            start: align_down(mapped.start, self.os_page),
            end: mapped.end,
        };
        let unlocked = span.minus(&self.locked);
        if unlocked.is_empty() {
            self.resident_from = 0;
        } else if self
            .last_residency_check
            .is_none_or(|at| at.elapsed() >= RESIDENCY_CHECK)
        {
            self.last_residency_check = Some(Instant::now());
            self.resident_from = self.check_residency(&unlocked, target);
        }
        mapped.starting_at_or_after(held_start(self.resident_from, self.locked))
    }

    /// Scans the unlocked ranges (OS-page-aligned starts) newest page first with `mincore`
    /// and returns the end of the newest evicted page (0: none). Resident pages that the lock
    /// will not take soon (outside the lock target, or any while locking waits for a retry)
    /// are read to mark them recently used, at most MAX_TOUCHES_PER_CHECK of them. Nothing
    /// older than an evicted page counts as held, so the scan stops there.
    fn check_residency(&mut self, unlocked: &[Window], target: Window) -> u64 {
        let os_page = self.os_page;
        let touch_end = if target.is_empty() || self.lock_retry_at.is_some() {
            u64::MAX
        } else {
            target.start
        };
        let mut residency = std::mem::take(&mut self.residency);
        let mut touches_left = 0;
        if self
            .last_touch
            .is_none_or(|at| at.elapsed() >= TOUCH_INTERVAL)
        {
            self.last_touch = Some(Instant::now());
            touches_left = MAX_TOUCHES_PER_CHECK;
        }
        let mut read_error = None;
        let mut evicted_end = 0;
        'scan: for range in unlocked.iter().rev() {
            for piece in segment_pieces(*range, self.segment_size).into_iter().rev() {
                let base = piece.segno * self.segment_size;
                let Some(segment) = self.segments.get(&piece.segno) else {
                    evicted_end = base + piece.offsets.end;
                    break 'scan;
                };
                let mut toucher: Option<Option<Toucher>> = None;
                let first = align_down(piece.offsets.start, os_page);
                let mut chunk_end = piece.offsets.end;
                while chunk_end > first {
                    let chunk_start =
                        align_down(chunk_end.saturating_sub(RESIDENCY_CHUNK * os_page), os_page)
                            .max(first);
                    if !segment.residency(&(chunk_start..chunk_end), os_page, &mut residency) {
                        evicted_end = base + chunk_end;
                        break 'scan;
                    }
                    for (i, flags) in residency.iter().enumerate().rev() {
                        let page = chunk_start + i as u64 * os_page;
                        if flags & 1 == 0 {
                            evicted_end = base + page + os_page;
                            break 'scan;
                        }
                        if touches_left == 0 || base + page + os_page > touch_end {
                            continue;
                        }
                        touches_left -= 1;
                        let toucher = toucher.get_or_insert_with(|| {
                            Toucher::open(
                                &segment_path(self.timeline, piece.segno, self.segment_size),
                                segment.identity,
                            )
                        });
                        if let Some(toucher) = toucher {
                            if let Err(error) = toucher.touch(page, &mut self.read_nowait) {
                                read_error = Some((piece.segno, page, error));
                                evicted_end = base + page + os_page;
                                break 'scan;
                            }
                        }
                    }
                    chunk_end = chunk_start;
                }
            }
        }
        self.residency = residency;
        if let Some((segno, offset, error)) = read_error {
            self.report_read_error(segno, offset, &error);
        }
        align_up(evicted_end, WAL_PAGE)
    }

    fn report_read_error(&mut self, segno: u64, offset: u64, error: &std::io::Error) {
        if self
            .last_read_error_report
            .is_some_and(|at| at.elapsed() < READ_ERROR_REPORT_INTERVAL)
        {
            return;
        }
        self.last_read_error_report = Some(Instant::now());
        report(
            PgLogLevel::WARNING,
            format!(
                "pg_ccm could not read file \"{}\" at offset {offset}: {}",
                self.path(segno),
                os_error_text(error)
            ),
            Some("The logical WAL cache does not count this page and older ones as held.".into()),
        );
    }
}
