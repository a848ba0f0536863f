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
//! `mlock()` is limited by RLIMIT_MEMLOCK (8 MB for an ordinary user on Debian). The worker
//! raises its soft limit to the hard one and locks the newest pages that fit; the older rest
//! of the window stays mapped, and on every residency check the worker touches its resident
//! pages, which marks them recently used so the kernel evicts other pages first (but may
//! still evict them). Pages found evicted are not read back: the window is reported as held
//! only from the newest evicted page on.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use ccm_walcache::{segment_pieces, segments_of, wal_file_name, Window, WAL_PAGE};

/// How often residency of the unlocked part is checked, and mapped files re-identified.
const RESIDENCY_CHECK: Duration = Duration::from_millis(100);
const IDENTITY_CHECK: Duration = Duration::from_secs(1);

/// One segment file mapped in full.
struct MappedSegment {
    address: *mut u8,
    length: usize,
    /// (device, inode) of the file when mapped: a recycled segment is renamed, so the name
    /// then points to another file.
    identity: (u64, u64),
}

impl MappedSegment {
    fn open(path: &str, segment_size: u64) -> Option<MappedSegment> {
        let file = std::fs::File::open(path).ok()?;
        let metadata = file.metadata().ok()?;
        // A short file would raise SIGBUS on access past its end.
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
                std::os::fd::AsRawFd::as_raw_fd(&file),
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
        debug_assert!(offsets.end as usize <= self.length);
        (
            unsafe { self.address.add(offsets.start as usize) }.cast(),
            (offsets.end - offsets.start) as usize,
        )
    }

    fn lock(&self, offsets: &std::ops::Range<u64>) -> std::io::Result<()> {
        let (address, length) = self.range(offsets);
        if unsafe { libc::mlock(address, length) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    fn unlock(&self, offsets: &std::ops::Range<u64>) {
        let (address, length) = self.range(offsets);
        unsafe { libc::munlock(address, length) };
    }

    /// Offset (within the range) of the end of the newest non-resident page, if any; the
    /// resident pages are touched so that the kernel sees them as recently used.
    fn check_residency(&self, offsets: &std::ops::Range<u64>) -> Option<u64> {
        let (address, length) = self.range(offsets);
        let os_page = page_size();
        let mut resident = vec![0u8; length.div_ceil(os_page)];
        if unsafe { libc::mincore(address, length, resident.as_mut_ptr()) } != 0 {
            return Some(length as u64); // unknown: claim nothing of this range
        }
        let mut newest_missing = None;
        for (i, flags) in resident.iter().enumerate() {
            if flags & 1 == 0 {
                newest_missing = Some(((i + 1) * os_page).min(length) as u64);
            } else {
                unsafe { std::ptr::read_volatile(address.cast::<u8>().add(i * os_page)) };
            }
        }
        newest_missing
    }
}

impl Drop for MappedSegment {
    fn drop(&mut self) {
        // Unmapping also unlocks.
        unsafe { libc::munmap(self.address.cast(), self.length) };
    }
}

fn page_size() -> usize {
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
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

pub struct SegmentCache {
    pages: u64,
    segment_size: u64,
    lock_budget: u64,
    lock_refused: bool,
    timeline: u32,
    segments: BTreeMap<u64, MappedSegment>,
    locked: Window,
    /// Start of the held window as of the last residency check of the unlocked part.
    resident_from: u64,
    last_residency_check: Option<Instant>,
    last_identity_check: Instant,
}

impl SegmentCache {
    pub fn new(pages: u64, segment_size: u64, lock_budget: u64) -> SegmentCache {
        SegmentCache {
            pages,
            segment_size,
            lock_budget,
            lock_refused: false,
            timeline: 0,
            segments: BTreeMap::new(),
            locked: Window::EMPTY,
            resident_from: 0,
            last_residency_check: None,
            last_identity_check: Instant::now(),
        }
    }

    fn path(&self, segno: u64) -> String {
        format!(
            "pg_wal/{}",
            wal_file_name(self.timeline, segno, self.segment_size)
        )
    }

    /// Lets go of everything (unmapping unlocks).
    pub fn release(&mut self) {
        self.segments.clear();
        self.locked = Window::EMPTY;
        self.last_residency_check = None;
    }

    /// Moves the cache to the newest pages behind `flush`, on `timeline`.
    pub fn advance(&mut self, flush: u64, timeline: u32) -> Coverage {
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
        self.move_lock(mapped);
        let held = self.resident_part(mapped);
        Coverage {
            held,
            locked: self.locked,
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
            self.segments.remove(&segno);
        }
    }

    /// Locks the newest pages of `mapped` that the budget allows and unlocks the rest.
    fn move_lock(&mut self, mapped: Window) {
        let target = if self.lock_refused {
            Window::EMPTY
        } else {
            mapped.newest_part(self.lock_budget)
        };
        for range in self.locked.minus(&target) {
            for piece in segment_pieces(range, self.segment_size) {
                if let Some(segment) = self.segments.get(&piece.segno) {
                    segment.unlock(&piece.offsets);
                }
            }
        }
        let old = self.locked;
        self.locked = target;
        for range in target.minus(&old) {
            for piece in segment_pieces(range, self.segment_size) {
                let Some(segment) = self.segments.get(&piece.segno) else {
                    continue;
                };
                if let Err(error) = segment.lock(&piece.offsets) {
                    self.refuse_locking(&error);
                    return;
                }
            }
        }
    }

    fn refuse_locking(&mut self, error: &std::io::Error) {
        pgrx::warning!(
            "pg_ccm could not lock logical WAL cache pages in memory: {error}; keeping them mapped only"
        );
        self.lock_refused = true;
        for segment in self.segments.values() {
            segment.unlock(&(0..segment.length as u64));
        }
        self.locked = Window::EMPTY;
    }

    /// The part of `mapped` in memory: the locked part, plus the older unlocked part from
    /// just after its newest evicted page (checked every RESIDENCY_CHECK).
    fn resident_part(&mut self, mapped: Window) -> Window {
        let unlocked = Window {
            start: mapped.start,
            end: if self.locked.is_empty() {
                mapped.end
            } else {
                self.locked.start
            },
        };
        if unlocked.is_empty() {
            return mapped;
        }
        let due = self
            .last_residency_check
            .is_none_or(|at| at.elapsed() >= RESIDENCY_CHECK);
        if due {
            self.last_residency_check = Some(Instant::now());
            self.resident_from = unlocked.start;
            for piece in segment_pieces(unlocked, self.segment_size) {
                let Some(segment) = self.segments.get(&piece.segno) else {
                    continue;
                };
                if let Some(missing_end) = segment.check_residency(&piece.offsets) {
                    let lsn = piece.segno * self.segment_size + piece.offsets.start + missing_end;
                    self.resident_from = lsn.div_ceil(WAL_PAGE) * WAL_PAGE;
                }
            }
        }
        mapped.starting_at_or_after(self.resident_from)
    }
}
