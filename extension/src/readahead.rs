//! Readahead for `ccm_prewarm`: threads that ask the kernel to start reading upcoming
//! blocks while the backend reads them into shared_buffers one by one.
//!
//! A backend reads one block at a time, so a cold, scattered list runs at the storage's
//! queue-depth-1 speed. posix_fadvise(WILLNEED) queues the reads without waiting for
//! them, but issuing it costs about 10 µs of CPU per call, which the backend would pay
//! between its own reads; and advising every 8 kB block separately splits sequential
//! reads the kernel would otherwise read ahead in large chunks. So the reads are grouped
//! into runs of consecutive blocks (at most `MAX_RUN_BLOCKS`), and
//! `ccm.prewarm_readahead_threads` threads advise those runs, never more than
//! `WINDOW_BLOCKS` ahead of the backend. Threads that read (pread) instead were measured
//! slower here: each blocking read costs a context switch, and two cores run out first.
//!
//! The threads run no PostgreSQL code at all: the backend computes every file path
//! before they start; they open files, advise and close them, nothing else. They are
//! started with every signal blocked, so PostgreSQL's signal handlers only ever run in
//! the backend's own thread, and they are joined before the backend goes on, also when
//! it leaves with an ERROR. A failed read in a thread is ignored: the backend's own read
//! decides what happens to that block.
//!
//! Each thread keeps one file open at a time. fd.c counts every descriptor a backend holds
//! against max_files_per_process, so the backend reserves one per thread with
//! AcquireExternalFD(), as postgres_fdw's connections and libpq-based code do, and starts
//! only as many threads as it got descriptors for; they are released when the threads are
//! joined.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// Longest run advised at once: 256 kB.
const MAX_RUN_BLOCKS: u32 = 32;
/// How far the threads may run ahead of the backend, in blocks.
const WINDOW_BLOCKS: usize = 2048;
const BLOCK_SIZE: u64 = pgrx::pg_sys::BLCKSZ as u64;
const SEGMENT_BLOCKS: u32 = pgrx::pg_sys::RELSEG_SIZE;

/// One advice: `blocks` blocks of one segment file, needed by the backend from read
/// number `first_read` on.
struct Run {
    /// False when the run continues the previous one: the kernel reads ahead of
    /// sequential reads by itself, and in larger chunks than we would advise.
    advise: bool,
    path: usize,
    segment: u32,
    first_block: u32,
    blocks: u32,
    first_read: usize,
}

/// The reads the backend will make, in order, as runs of file ranges.
#[derive(Default)]
pub struct ReadaheadPlan {
    /// Path of each fork's first segment, relative to the data directory.
    paths: Vec<String>,
    runs: Vec<Run>,
}

impl ReadaheadPlan {
    /// An empty plan with room for `forks` paths and `reads` reads, so that `add_fork` and
    /// `push` allocate nothing more (but the paths themselves); an error if the room cannot
    /// be had.
    pub fn try_with_capacity(forks: usize, reads: usize) -> Result<Self, std::collections::TryReserveError> {
        let mut plan = ReadaheadPlan::default();
        plan.paths.try_reserve_exact(forks)?;
        plan.runs.try_reserve_exact(reads)?;
        Ok(plan)
    }

    /// Registers a fork's path; returns its index for `push`.
    pub fn add_fork(&mut self, path: String) -> usize {
        self.paths.push(path);
        self.paths.len() - 1
    }

    /// Appends the backend's next read: block `block` of fork `path`.
    pub fn push(&mut self, path: usize, block: u32, read_index: usize) {
        let segment = block / SEGMENT_BLOCKS;
        let mut advise = true;
        if let Some(run) = self.runs.last_mut() {
            let contiguous = run.path == path && run.segment == segment && run.first_block + run.blocks == block;
            if contiguous && run.blocks < MAX_RUN_BLOCKS {
                run.blocks += 1;
                return;
            }
            advise = !contiguous;
        }
        self.runs.push(Run { advise, path, segment, first_block: block, blocks: 1, first_read: read_index });
    }

    fn file_name(&self, run: &Run) -> String {
        match run.segment {
            0 => self.paths[run.path].clone(),
            segment => format!("{}.{segment}", self.paths[run.path]),
        }
    }

    /// Runs `body` while `threads` threads advise ahead of it. `body` reports each read
    /// it starts through the `Progress` it is given.
    pub fn run<R>(&self, threads: usize, body: impl FnOnce(&Progress) -> R) -> R {
        let progress = Progress { done: AtomicUsize::new(0), stop: AtomicBool::new(false) };
        if threads == 0 || self.runs.len() < 2 {
            return body(&progress);
        }
        // Released after the scope has joined the threads (declared before it), also when
        // the body leaves with an ERROR.
        let descriptors = ExternalDescriptors::acquire(threads);
        let next_run = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            // Stops the threads when the body finishes or unwinds (an ERROR), before the
            // scope joins them.
            let _stop = StopOnDrop(&progress.stop);
            let spawned = with_signals_blocked(|| {
                (0..descriptors.count)
                    .map(|_| std::thread::Builder::new().spawn_scoped(scope, || self.worker(&next_run, &progress)))
                    .take_while(Result::is_ok)
                    .count()
            });
            if spawned == 0 {
                pgrx::debug1!(
                    "pg_ccm: no readahead thread could start ({} of {threads} file descriptors reserved); reading without them",
                    descriptors.count
                );
            }
            body(&progress)
        })
    }

    fn worker(&self, next_run: &AtomicUsize, progress: &Progress) {
        let mut open: Option<(String, File)> = None;
        loop {
            let index = next_run.fetch_add(1, Ordering::Relaxed);
            let Some(run) = self.runs.get(index) else { return };
            // Stay within the window: reading too far ahead only fills the page cache
            // with pages that may be evicted again before the backend gets to them.
            while run.first_read > progress.done.load(Ordering::Relaxed) + WINDOW_BLOCKS {
                if progress.stop.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            if progress.stop.load(Ordering::Relaxed) {
                return;
            }
            if !run.advise {
                continue;
            }
            let name = self.file_name(run);
            if open.as_ref().is_none_or(|(path, _)| *path != name) {
                open = File::open(&name).ok().map(|file| (name, file));
            }
            if let Some((_, file)) = &open {
                let length = (u64::from(run.blocks) * BLOCK_SIZE) as usize;
                let offset = u64::from(run.first_block % SEGMENT_BLOCKS) * BLOCK_SIZE;
                // A failure only costs the prefetch: the backend's own read decides.
                unsafe {
                    libc::posix_fadvise(file.as_raw_fd(), offset as i64, length as i64, libc::POSIX_FADV_WILLNEED)
                };
            }
        }
    }
}

/// Where the backend is: the threads pace themselves by it.
pub struct Progress {
    done: AtomicUsize,
    stop: AtomicBool,
}

impl Progress {
    /// The backend is about to make read number `index`.
    pub fn reading(&self, index: usize) {
        self.done.store(index, Ordering::Relaxed);
    }
}

/// File descriptors reserved with fd.c for the threads, released on drop.
struct ExternalDescriptors {
    count: usize,
}

impl ExternalDescriptors {
    /// Reserves up to `wanted` descriptors; fewer (or none) when fd.c has no more to give.
    fn acquire(wanted: usize) -> Self {
        let count = (0..wanted).take_while(|_| unsafe { pgrx::pg_sys::AcquireExternalFD() }).count();
        ExternalDescriptors { count }
    }
}

impl Drop for ExternalDescriptors {
    fn drop(&mut self) {
        for _ in 0..self.count {
            unsafe { pgrx::pg_sys::ReleaseExternalFD() };
        }
    }
}

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs `spawn` with every signal blocked in the calling thread, so that the threads it
/// starts inherit a full mask; the backend's own mask is restored afterwards.
fn with_signals_blocked<R>(spawn: impl FnOnce() -> R) -> R {
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut previous);
        let result = spawn();
        libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut());
        result
    }
}
