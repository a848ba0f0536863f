//! The second tier (DESIGN.md, "Beyond Aurora: the page cache"): which relation-file pages
//! the kernel's page cache holds on one node (`ccm_os_cached_blocks`), and reading the
//! missing ones into another node's page cache (`ccm_os_prefetch`), never into shared_buffers.
//!
//! `ccm_os_cached_blocks` walks the main-fork segment files of the permanent relations of
//! every database and tablespace in ascending (tablespace, database, relfilenode, block)
//! order from a cursor, maps each file (PROT_READ, MAP_SHARED), asks mincore(2) which of its
//! pages are resident and unmaps it. No page is ever touched, so a file truncated meanwhile
//! cannot raise SIGBUS. mincore reports the pages of files the caller owns, and the backend
//! owns the data directory. A block counts as cached when all of its OS pages are.
//! Unlogged relations (those with an init fork), temporary relations, free-space and
//! visibility maps are left out: a standby has no use for them.
//!
//! `ccm_os_prefetch` runs on a standby: for each block of a list it measures residency the
//! same way and asks the kernel to read the missing ones, posix_fadvise(POSIX_FADV_WILLNEED)
//! on contiguous runs of at most `ADVISE_RUN_BLOCKS`, as pg_prewarm's 'prefetch' mode does
//! through smgrprefetch. It opens the segment files itself, read-only: it never touches
//! shared_buffers, takes no lock (heavyweight or LWLock) and pins nothing, so replay never
//! waits for it. A relation truncated or dropped by replay meanwhile only costs an advice
//! about pages past the end of a file, or of an unlinked file the kernel frees on close.
//! Like any standby query it can still be cancelled by a snapshot conflict.
//!
//! A page read ahead on advice is on the kernel's inactive list, never accessed: the first
//! to go when the standby's own reads and writes (its WAL above all) need memory, while the
//! primary keeps the same pages on its active list by using them. So once a probed range's
//! runs are advised, each is read twice (pread into a scratch buffer, waiting for the advice's
//! I/O), which moves its pages to the active list as two accesses by a reader would; pages
//! already cached are not touched, so the copy costs only what is read. Measured: a standby
//! in a 640 MB memory group kept 6% of a 200 MB table it had only advised after the WAL of a
//! 200 MB write had streamed through it, and 93% once read twice (bench/os_cache_churn.py).
//!
//! Advice fills the page cache, so it is budgeted: the memory free when the call starts
//! (MemFree, or the cgroup's limit less its usage: `ccm_walcache::free_memory`) less
//! `ccm.os_cache_min_free`, computed once. Blocks beyond the budget are skipped and the call
//! says it was limited; the kernel evicts nothing to make room for ours.
//!
//! With `debug_io_direct = data` (PostgreSQL 16+) relation data bypasses the page cache:
//! both functions then do nothing and say so (`in_play` false).
//!
//! Files are opened with std, outside fd.c, one at a time: each function reserves that one
//! descriptor with ReserveExternalFD() for the call.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use ccm_codec::{BlockListEncoder, BlockListView, HotBlock, RelFork, MAX_BLOCK};
use pgrx::prelude::*;

use crate::catalog_oid::CatalogOid;
use crate::compat;
use crate::errors;
use crate::gucs;
use crate::prewarm;

const BLOCK_SIZE: u64 = pg_sys::BLCKSZ as u64;
const SEGMENT_BLOCKS: u64 = pg_sys::RELSEG_SIZE as u64;
/// pg_default and pg_global (fixed catalog OIDs).
const DEFAULT_TABLESPACE: u32 = 1663;
const GLOBAL_TABLESPACE: u32 = 1664;
/// Most blocks either function handles per call (as ccm_prewarm).
const MAX_BLOCKS: u64 = 1 << 20;
/// Most segment files one ccm_os_cached_blocks() call examines.
const MAX_FILES: i32 = 100_000;
/// Most blocks of files one ccm_os_cached_blocks() call goes through (8 GB), whatever
/// max_files says: mincore visits every page, cached or not (about 9 ms per GB of a file
/// nothing of which is cached, 14 ms when all is), so a call over cold files stays short while
/// one over many small files still takes them all.
const MAX_EXAMINED_BLOCKS: u64 = 1 << 20;
/// Blocks mapped and probed at once (128 MB with 8 kB blocks): the residency vector then
/// needs 32 kB with 4 kB pages, reserved once per call.
const PROBE_BLOCKS: u64 = 16384;
/// Longest run advised at once: 2 MB.
const ADVISE_RUN_BLOCKS: u64 = 256;
/// Runs advised in one probed range at most: runs of missing blocks are separated by cached
/// ones, and long ones are cut at `ADVISE_RUN_BLOCKS`.
const MAX_RUNS: usize = (PROBE_BLOCKS / 2 + PROBE_BLOCKS / ADVISE_RUN_BLOCKS + 1) as usize;
/// Reads of an advised run: two accesses move a page to the kernel's active list.
const TOUCHES: usize = 2;

/// What a directory entry of a database directory is, by its name alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileName {
    /// `<relfilenode>` or `<relfilenode>.<segment>`: a segment of a main fork.
    MainFork { rel: u32, segment: u32 },
    /// `<relfilenode>_init` (or a segment of it): the relation is unlogged.
    InitFork { rel: u32 },
    /// Anything else: other forks, temporary relations, PG_VERSION, pg_filenode.map...
    Other,
}

/// A positive decimal number without leading zeros, as PostgreSQL writes relfilenodes and
/// segment numbers.
fn decimal(text: &str) -> Option<u32> {
    let canonical = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) && !text.starts_with('0');
    canonical.then(|| text.parse().ok()).flatten()
}

/// Classifies a file name of a database directory.
pub fn classify(name: &str) -> FileName {
    let (stem, segment) = match name.split_once('.') {
        Some((stem, segment)) => match decimal(segment) {
            Some(segment) => (stem, segment),
            None => return FileName::Other,
        },
        None => (name, 0),
    };
    if let Some(rel) = decimal(stem) {
        return FileName::MainFork { rel, segment };
    }
    match stem.strip_suffix("_init").and_then(decimal) {
        Some(rel) => FileName::InitFork { rel },
        None => FileName::Other,
    }
}

/// One descriptor reserved with fd.c for the files this call opens itself.
pub(crate) struct ExternalFd;

impl ExternalFd {
    pub(crate) fn reserve() -> Self {
        unsafe { pg_sys::ReserveExternalFD() };
        ExternalFd
    }
}

impl Drop for ExternalFd {
    fn drop(&mut self) {
        unsafe { pg_sys::ReleaseExternalFD() };
    }
}

/// An open directory (libc's), closed on drop; its entries are read without allocating.
pub(crate) struct Dir(*mut libc::DIR);

impl Dir {
    pub(crate) fn open(path: &str) -> Option<Dir> {
        let path = std::ffi::CString::new(path).ok()?;
        let dir = unsafe { libc::opendir(path.as_ptr()) };
        (!dir.is_null()).then_some(Dir(dir))
    }

    /// The directory's own descriptor, for openat(2) of its entries.
    pub(crate) fn fd(&self) -> i32 {
        unsafe { libc::dirfd(self.0) }
    }

    /// Calls `each` with every entry's name that is valid UTF-8.
    pub(crate) fn for_each(&self, mut each: impl FnMut(&str)) {
        loop {
            let entry = unsafe { libc::readdir(self.0) };
            if entry.is_null() {
                return;
            }
            if let Ok(name) = unsafe { CStr::from_ptr((*entry).d_name.as_ptr()) }.to_str() {
                each(name);
            }
        }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        unsafe { libc::closedir(self.0) };
    }
}

/// Appends to a vector or raises the out-of-memory ERROR.
fn try_push<T>(vec: &mut Vec<T>, value: T, what: &str) {
    if vec.try_reserve(1).is_err() {
        errors::out_of_memory(what, ((vec.len() + 1) * std::mem::size_of::<T>()) as u64);
    }
    vec.push(value);
}

/// The numeric entries of a directory, sorted (none if it cannot be read).
fn numbered_entries(path: &str) -> Vec<u32> {
    let mut numbers = Vec::new();
    if let Some(dir) = Dir::open(path) {
        dir.for_each(|name| {
            if let Some(number) = decimal(name) {
                try_push(&mut numbers, number, "a directory listing");
            }
        });
    }
    numbers.sort_unstable();
    numbers
}

/// The main-fork segment files of the permanent relations in a database directory, as
/// (relfilenode, segment), sorted.
fn main_fork_files(path: &str) -> Vec<(u32, u32)> {
    let (mut files, mut unlogged) = (Vec::new(), Vec::new());
    if let Some(dir) = Dir::open(path) {
        dir.for_each(|name| match classify(name) {
            FileName::MainFork { rel, segment } => try_push(&mut files, (rel, segment), "a directory listing"),
            FileName::InitFork { rel } => try_push(&mut unlogged, rel, "a directory listing"),
            FileName::Other => {}
        });
    }
    unlogged.sort_unstable();
    files.retain(|(rel, _)| unlogged.binary_search(rel).is_err());
    files.sort_unstable();
    files
}

/// The system's page size and room for the residency bytes of `PROBE_BLOCKS` blocks.
struct Probe {
    page: u64,
    pages: Vec<u8>,
}

/// The residency of a range of blocks of one file, as mincore reported it.
struct Residency<'a> {
    pages: &'a [u8],
    page: u64,
    /// Bytes from the start of the mapping (page aligned) to the range's first block.
    skew: u64,
}

impl Residency<'_> {
    /// Whether every page of block `index` of the range is resident.
    fn cached(&self, index: u64) -> bool {
        let start = self.skew + index * BLOCK_SIZE;
        let (first, last) = ((start / self.page) as usize, ((start + BLOCK_SIZE - 1) / self.page) as usize);
        self.pages.get(first..=last).is_some_and(|pages| pages.iter().all(|byte| byte & 1 == 1))
    }
}

impl Probe {
    fn new() -> Probe {
        let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok().filter(|&p| p > 0).unwrap_or(4096);
        let len = (PROBE_BLOCKS * BLOCK_SIZE).div_ceil(page) as usize + 1;
        let mut pages = Vec::new();
        if pages.try_reserve_exact(len).is_err() {
            errors::out_of_memory("a page residency vector", len as u64);
        }
        Probe { page, pages }
    }

    /// Which of `count` (at most `PROBE_BLOCKS`) blocks of `file` from block `first` (of
    /// the file) are resident; None if the range could not be mapped.
    fn residency(&mut self, file: &File, first: u64, count: u64) -> Option<Residency<'_>> {
        let start = first * BLOCK_SIZE;
        let offset = start - start % self.page;
        let len = (start + count * BLOCK_SIZE - offset) as usize;
        let pages = (len as u64).div_ceil(self.page) as usize;
        if count == 0 || count > PROBE_BLOCKS || pages > self.pages.capacity() {
            return None;
        }
        self.pages.clear();
        self.pages.resize(pages, 0);
        // SAFETY: a fresh read-only mapping of our own descriptor, never dereferenced:
        // mincore only asks the kernel about it, and it is unmapped at once.
        let resident = unsafe {
            let addr = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), offset as libc::off_t);
            if addr == libc::MAP_FAILED {
                return None;
            }
            let result = libc::mincore(addr, len, self.pages.as_mut_ptr());
            libc::munmap(addr, len);
            result == 0
        };
        resident.then_some(Residency { pages: &self.pages, page: self.page, skew: start - offset })
    }
}

/// An open segment file and its size in whole blocks; None when it cannot be opened.
fn open_segment(path: &str) -> Option<(File, u64)> {
    let file = File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    Some((file, (len / BLOCK_SIZE).min(SEGMENT_BLOCKS)))
}

/// The file name of segment `segment` of a fork whose first segment is `path`.
fn segment_path(path: &str, segment: u64) -> String {
    match segment {
        0 => path.to_string(),
        _ => format!("{path}.{segment}"),
    }
}

/// A position in the walk: the last block listed or examined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Cursor {
    spc: u32,
    db: u32,
    rel: u32,
    /// -1: before the relation's first block.
    block: i64,
}

/// One ccm_os_cached_blocks() call.
struct Walk {
    after: Cursor,
    last: Cursor,
    encoder: BlockListEncoder,
    max_blocks: usize,
    max_files: i32,
    files: i32,
    examined: u64,
    probe: Probe,
}

impl Walk {
    /// Walks every tablespace from the cursor on; true when it reached the end.
    fn run(&mut self) -> bool {
        let mut spaces = vec![DEFAULT_TABLESPACE, GLOBAL_TABLESPACE];
        spaces.extend(numbered_entries("pg_tblspc").into_iter().filter(|&spc| spc > GLOBAL_TABLESPACE));
        spaces.sort_unstable();
        let from = self.after.spc;
        spaces.into_iter().filter(|&spc| spc >= from).all(|spc| self.tablespace(spc))
    }

    /// The databases of one tablespace; false when the walk stopped.
    fn tablespace(&mut self, spc: u32) -> bool {
        let databases = match spc {
            DEFAULT_TABLESPACE => numbered_entries("base"),
            GLOBAL_TABLESPACE => vec![0],
            _ => {
                // pg_tblspc/<spc>/<version directory>/, whatever this server's version is.
                let path = compat::database_path(spc, 0);
                path.rsplit_once('/').map(|(version_dir, _)| numbered_entries(version_dir)).unwrap_or_default()
            }
        };
        let from = if spc == self.after.spc { self.after.db } else { 0 };
        databases.into_iter().filter(|&db| db >= from).all(|db| self.database(spc, db))
    }

    /// The files of one database directory; false when the walk stopped.
    fn database(&mut self, spc: u32, db: u32) -> bool {
        let dir = compat::database_path(spc, db);
        for (rel, segment) in main_fork_files(&dir) {
            let first = i64::from(segment) * SEGMENT_BLOCKS as i64;
            let last_possible = first + SEGMENT_BLOCKS as i64 - 1;
            if (Cursor { spc, db, rel, block: last_possible }) <= self.after {
                continue;
            }
            pg_sys::check_for_interrupts!();
            let path = segment_path(&format!("{dir}/{rel}"), u64::from(segment));
            if !self.segment(RelFork { spc, db, rel, fork: 0 }, &path, segment) {
                return false;
            }
        }
        true
    }

    /// Examines one segment file from the cursor on; false when the walk stopped.
    fn segment(&mut self, rel: RelFork, path: &str, segment: u32) -> bool {
        let Some((file, blocks)) = open_segment(path) else { return true };
        let first = u64::from(segment) * SEGMENT_BLOCKS;
        // The last segment ends before InvalidBlockNumber.
        let blocks = blocks.min(u64::from(MAX_BLOCK) + 1 - first.min(u64::from(MAX_BLOCK) + 1));
        let here = Cursor { spc: rel.spc, db: rel.db, rel: rel.rel, block: -1 };
        let start = if (here.spc, here.db, here.rel) == (self.after.spc, self.after.db, self.after.rel) {
            u64::try_from(self.after.block.saturating_add(1) - first as i64).unwrap_or(0)
        } else {
            0
        };
        if start >= blocks {
            return true;
        }
        self.files += 1;
        let mut next = start;
        while next < blocks {
            let count = (blocks - next).min(PROBE_BLOCKS);
            let listed = self.probe_range(rel, &file, first, next, count);
            self.examined += listed;
            self.last = Cursor { block: (first + next + listed) as i64 - 1, ..here };
            if self.encoder.len() >= self.max_blocks || self.examined >= MAX_EXAMINED_BLOCKS {
                return false;
            }
            next += count;
        }
        self.files < self.max_files
    }

    /// Lists the cached blocks among `count` blocks of a file from `next` on, stopping at
    /// `max_blocks`; returns how many blocks it went through.
    fn probe_range(&mut self, rel: RelFork, file: &File, first: u64, next: u64, count: u64) -> u64 {
        let Some(residency) = self.probe.residency(file, next, count) else { return count };
        for index in 0..count {
            if residency.cached(index) {
                let block = rel.block((first + next + index) as u32);
                if let Err(error) = self.encoder.push(HotBlock { addr: block, usage: 0 }) {
                    errors::encode_failed(&error);
                }
                if self.encoder.len() >= self.max_blocks {
                    return index + 1;
                }
            }
        }
        count
    }
}

/// Checks a bound argument, raising 22023 outside `1..=max`.
fn check_bound(name: &str, value: i64, max: i64) {
    if !(1..=max).contains(&value) {
        errors::invalid_argument(
            format!("{name} must be between 1 and {max}: {value}"),
            Some(format!("One call of ccm_os_cached_blocks() lists at most {MAX_BLOCKS} blocks and examines at most {MAX_FILES} segment files ({MAX_EXAMINED_BLOCKS} blocks of them); call it again from the cursor it returns.")),
        );
    }
}

/// The blocks of relation files cached in this node's page cache, from a cursor on.
#[pg_extern(volatile, parallel_unsafe)]
fn ccm_os_cached_blocks(
    after_spc: pg_sys::Oid,
    after_db: pg_sys::Oid,
    after_rel: pg_sys::Oid,
    after_block: i64,
    max_blocks: i64,
    max_files: i32,
) -> TableIterator<
    'static,
    (
        name!(list, Vec<u8>),
        name!(last_spc, CatalogOid),
        name!(last_db, CatalogOid),
        name!(last_rel, CatalogOid),
        name!(last_block, i64),
        name!(complete, bool),
        name!(files, i32),
        name!(in_play, bool),
    ),
> {
    errors::require_enabled();
    check_bound("max_blocks", max_blocks, MAX_BLOCKS as i64);
    check_bound("max_files", i64::from(max_files), i64::from(MAX_FILES));
    if after_block < -1 {
        errors::invalid_argument(
            format!("after_block must be -1 or a block number: {after_block}"),
            Some("The cursor (0, 0, 0, -1) starts from the beginning.".into()),
        );
    }
    let after = Cursor { spc: after_spc.to_u32(), db: after_db.to_u32(), rel: after_rel.to_u32(), block: after_block };
    let in_play = !compat::data_bypasses_page_cache();
    let mut walk = Walk {
        after,
        last: after,
        encoder: BlockListEncoder::new(),
        max_blocks: max_blocks as usize,
        max_files,
        files: 0,
        examined: 0,
        probe: Probe::new(),
    };
    let complete = {
        let _fd = ExternalFd::reserve();
        !in_play || walk.run()
    };
    let listed = walk.encoder.len() as u64;
    let list = walk.encoder.finish(listed, walk.examined).unwrap_or_else(|error| errors::encode_failed(&error));
    let last = walk.last;
    TableIterator::once((
        list,
        CatalogOid(last.spc),
        CatalogOid(last.db),
        CatalogOid(last.rel),
        last.block,
        complete,
        walk.files,
        in_play,
    ))
}

/// Room, reserved once per call, to read advised runs back (`TOUCHES` times each).
struct Touch {
    /// The runs advised in the range being probed: (first block of the file, blocks).
    runs: Vec<(u64, u64)>,
    buffer: Vec<u8>,
}

impl Touch {
    fn new() -> Touch {
        let mut runs = Vec::new();
        if runs.try_reserve_exact(MAX_RUNS).is_err() {
            errors::out_of_memory("a list of advised runs", (MAX_RUNS * std::mem::size_of::<(u64, u64)>()) as u64);
        }
        let len = (ADVISE_RUN_BLOCKS * BLOCK_SIZE) as usize;
        let mut buffer = Vec::new();
        if buffer.try_reserve_exact(len).is_err() {
            errors::out_of_memory("a read buffer", len as u64);
        }
        buffer.resize(len, 0);
        Touch { runs, buffer }
    }

    /// Reads the runs advised so far in `file`, `TOUCHES` times each, and forgets them. A
    /// short read (the file truncated meanwhile) or a failed one is no matter: only the
    /// pages' place on the kernel's lists is at stake.
    fn read_back(&mut self, file: &File) {
        for &(first, count) in &self.runs {
            let len = ((count * BLOCK_SIZE) as usize).min(self.buffer.len());
            for _ in 0..TOUCHES {
                let _ = file.read_at(&mut self.buffer[..len], first * BLOCK_SIZE);
            }
            pg_sys::check_for_interrupts!();
        }
        self.runs.clear();
    }
}

/// What one ccm_os_prefetch() call did with its blocks.
struct Prefetch {
    already_cached: u64,
    advised: u64,
    skipped: u64,
    limited: bool,
    /// Bytes that may still be advised; None: measure only.
    budget: Option<u64>,
    /// None when measuring only.
    touch: Option<Touch>,
}

impl Prefetch {
    fn new(budget: Option<u64>) -> Prefetch {
        let touch = budget.map(|_| Touch::new());
        Prefetch { already_cached: 0, advised: 0, skipped: 0, limited: false, budget, touch }
    }

    /// Advises `count` blocks of `file` from block `first` (of the file) while the budget
    /// lasts; the rest are skipped.
    fn advise(&mut self, file: &File, first: u64, count: u64) {
        let Some(budget) = self.budget else { return };
        let allowed = count.min(budget / BLOCK_SIZE);
        if allowed > 0 {
            let (offset, len) = ((first * BLOCK_SIZE) as libc::off_t, (allowed * BLOCK_SIZE) as libc::off_t);
            if unsafe { libc::posix_fadvise(file.as_raw_fd(), offset, len, libc::POSIX_FADV_WILLNEED) } == 0 {
                self.advised += allowed;
                self.budget = Some(budget - allowed * BLOCK_SIZE);
                if let Some(touch) = self.touch.as_mut().filter(|t| t.runs.len() < MAX_RUNS) {
                    touch.runs.push((first, allowed));
                }
            } else {
                self.skipped += allowed;
            }
        }
        if allowed < count {
            self.skipped += count - allowed;
            self.limited = true;
        }
    }

    /// Measures `count` blocks of `file` from block `first` (of the file) and advises the
    /// missing ones, in runs of consecutive blocks.
    fn range(&mut self, probe: &mut Probe, file: &File, first: u64, count: u64) {
        let mut next = 0;
        while next < count {
            let chunk = (count - next).min(PROBE_BLOCKS);
            let mut missing: Option<(u64, u64)> = None;
            // A range that cannot be mapped is taken as missing: advising it is harmless.
            let residency = probe.residency(file, first + next, chunk);
            for index in 0..chunk {
                let cached = residency.as_ref().is_some_and(|r| r.cached(index));
                if cached {
                    self.already_cached += 1;
                    continue;
                }
                let block = first + next + index;
                missing = match missing {
                    Some((start, len)) if start + len == block && len < ADVISE_RUN_BLOCKS => Some((start, len + 1)),
                    Some((start, len)) => {
                        self.advise(file, start, len);
                        Some((block, 1))
                    }
                    None => Some((block, 1)),
                };
            }
            if let Some((start, len)) = missing {
                self.advise(file, start, len);
            }
            // All of the range's advice is in flight before the first read waits for it.
            if let Some(touch) = self.touch.as_mut() {
                touch.read_back(file);
            }
            next += chunk;
            pg_sys::check_for_interrupts!();
        }
    }
}

/// Prefetches the blocks of one relation fork of a list.
fn prefetch_fork(state: &mut Prefetch, probe: &mut Probe, rel: RelFork, runs: impl Iterator<Item = (u32, u32)>) {
    let path = compat::relation_path(rel);
    let mut open: Option<(u64, Option<(File, u64)>)> = None;
    for (first, last) in runs {
        pg_sys::check_for_interrupts!();
        let (mut block, end) = (u64::from(first), u64::from(last) + 1);
        while block < end {
            let segment = block / SEGMENT_BLOCKS;
            let piece_end = end.min((segment + 1) * SEGMENT_BLOCKS);
            if open.as_ref().is_none_or(|(number, _)| *number != segment) {
                open = Some((segment, open_segment(&segment_path(&path, segment))));
            }
            let in_file = open.as_ref().and_then(|(_, file)| file.as_ref());
            let (start, count) = (block - segment * SEGMENT_BLOCKS, piece_end - block);
            match in_file {
                Some((file, blocks)) => {
                    let present = count.min(blocks.saturating_sub(start));
                    if present > 0 {
                        state.range(probe, file, start, present);
                    }
                    state.skipped += count - present;
                }
                None => state.skipped += count,
            }
            block = piece_end;
        }
    }
}

/// Reads the blocks of a list into this standby's page cache (not its shared_buffers).
#[pg_extern(volatile, parallel_unsafe)]
fn ccm_os_prefetch(
    list: &[u8],
    advise: default!(bool, true),
) -> TableIterator<
    'static,
    (
        name!(requested, i64),
        name!(already_cached, i64),
        name!(advised, i64),
        name!(skipped, i64),
        name!(limited, bool),
        name!(in_play, bool),
    ),
> {
    errors::require_enabled();
    prewarm::require_recovery_for("ccm_os_prefetch() reads blocks into the page cache only on a standby.");
    let view = BlockListView::parse_bounded(list, MAX_BLOCKS).unwrap_or_else(|error| {
        errors::block_list_refused(&error, &format!("ccm_os_prefetch() accepts lists of up to {MAX_BLOCKS} blocks."))
    });
    let requested = view.len() as i64;
    if compat::data_bypasses_page_cache() {
        return TableIterator::once((requested, 0, 0, 0, false, false));
    }
    let min_free = u64::try_from(gucs::OS_CACHE_MIN_FREE.get()).unwrap_or(0) << 20;
    let budget = advise.then(|| ccm_walcache::free_memory().unwrap_or(0).saturating_sub(min_free));
    let mut state = Prefetch::new(budget);
    let mut probe = Probe::new();
    let _fd = ExternalFd::reserve();
    for group in view.groups() {
        if group.rel().fork != 0 {
            state.skipped += group.len() as u64;
            continue;
        }
        prefetch_fork(&mut state, &mut probe, group.rel(), group.runs());
    }
    debug1!(
        "pg_ccm os prefetch: {requested} requested, {} already cached, {} advised, {} skipped, limited {}, budget left {:?}",
        state.already_cached,
        state.advised,
        state.skipped,
        state.limited,
        state.budget
    );
    TableIterator::once((
        requested,
        state.already_cached as i64,
        state.advised as i64,
        state.skipped as i64,
        state.limited,
        true,
    ))
}

extension_sql!(
    r#"
COMMENT ON FUNCTION ccm_os_cached_blocks(oid, oid, oid, int8, int8, int4) IS 'blocks of permanent relations'' main forks that this node''s page cache holds, from a cursor on (for ccm-agent)';
COMMENT ON FUNCTION ccm_os_prefetch(bytea, bool) IS 'reads the listed blocks into this standby''s page cache, not its shared_buffers, while memory is free (for ccm-agent)';
"#,
    name = "os_cache_comments",
    requires = [ccm_os_cached_blocks, ccm_os_prefetch],
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn main_fork_names() {
        assert_eq!(classify("16384"), FileName::MainFork { rel: 16384, segment: 0 });
        assert_eq!(classify("16384.1"), FileName::MainFork { rel: 16384, segment: 1 });
        assert_eq!(classify("1259.32767"), FileName::MainFork { rel: 1259, segment: 32767 });
        assert_eq!(classify("16384_init"), FileName::InitFork { rel: 16384 });
        assert_eq!(classify("16384_init.2"), FileName::InitFork { rel: 16384 });
        for name in [
            "16384_fsm", "16384_vm", "16384_fsm.1", "t3_16384", "t3_16384.1", "t3_16384_init", "PG_VERSION",
            "pg_filenode.map", "pg_internal.init", "pgsql_tmp", ".", "..", "", "16384.", ".1", "16384.0",
            "16384.01", "016384", "0", "16384.1.1", "16384x", "4294967296", "16384.4294967296", "+1", "1_init_init",
            "_init",
        ] {
            assert_eq!(classify(name), FileName::Other, "{name:?}");
        }
    }

    #[test]
    fn io_direct_settings() {
        assert!(compat::io_direct_names_data("data"));
        assert!(compat::io_direct_names_data("wal, data"));
        assert!(compat::io_direct_names_data("DATA,wal_init"));
        assert!(!compat::io_direct_names_data(""));
        assert!(!compat::io_direct_names_data("wal,wal_init"));
        assert!(!compat::io_direct_names_data("database"));
    }
}
