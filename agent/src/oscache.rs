//! The page-cache tier (extension 0.9.0): which slice of the primary's page cache to read
//! next, which batches each failover candidate still has to read, and how much of the
//! primary's page cache each candidate held in its last complete pass. Pure: no I/O, so
//! that the unit tests below drive it through every case.
//!
//! A *pass* walks the primary's relation files from start to end in slices
//! (`ccm_os_cached_blocks`, at most `SLICE_BLOCKS` resident blocks or `SLICE_FILES` segment
//! files each), read before the standbys' warm tasks start. Each slice is split into batches of `BATCH_BLOCKS` in file order and queued
//! for every candidate that is up; each candidate's task reads its queue with
//! `ccm_os_prefetch`, after its share of the shared_buffers hot set and only while the cycle
//! has time left, so the page cache never delays the hot set. The next slice is read once
//! every candidate that is up has emptied its queue: a slow candidate slows the pass, and a
//! candidate that is down is not waited for (its queue is dropped and its pass is partial).
//!
//! What a candidate holds is measured by the standby itself (mincore over its own files):
//! a pass's coverage is the blocks it already held over the blocks the primary held, counted
//! before anything was read, so a pass that had to read shows the figure from before the
//! read and the next pass shows the result. A pass in which no candidate had to read
//! anything (or only memory headroom stopped it) is followed by a pause (`pause`, default
//! 2 min): the primary's page cache moves slowly, and a pass costs 15 to 18 ms of CPU per GB
//! of page cache on each node and half a byte per cached block on the wire, twice
//! (bench/os_cache_cost.py at 8 GB): at 64 GB, a pass every 2 minutes is about 1% of a core
//! and 69 kB/s. A pass that read anything is followed by the next at once, which confirms it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Resident blocks per slice of the primary's page cache: 1 GB.
pub const SLICE_BLOCKS: i64 = 131_072;
/// Segment files examined per slice at most. The extension also ends a slice after 8 GB of
/// files (mincore visits every page, cached or not), so a slice of cold files stays short,
/// while one of many small files takes them all: each call lists the database directories it
/// walks again, and a database of many relations would otherwise take a call per few files.
pub const SLICE_FILES: i32 = 2048;
/// Blocks per ccm_os_prefetch call: 128 MB, about a second of a cloud volume's 125 MB/s.
pub const BATCH_BLOCKS: usize = 16_384;
/// Slices queued for a candidate at most; beyond that it has fallen behind and its pass is
/// given up (it starts again with the next pass).
pub const MAX_QUEUED_BATCHES: usize = 64;

/// Whether a standby whose own client sessions run `busy` queries now waits with its
/// page-cache reading (`os_cache_busy_sessions`, 0: never): its readers come first, since the
/// reading takes CPU and disk from them (bench/standby_reader.py).
pub fn readers_first(busy: u64, busy_sessions: u32) -> bool {
    busy_sessions > 0 && busy >= u64::from(busy_sessions)
}

/// Where the walk of the primary's files stands: the last block examined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub spc: u32,
    pub db: u32,
    pub rel: u32,
    pub block: i64,
}

impl Cursor {
    pub const START: Cursor = Cursor {
        spc: 0,
        db: 0,
        rel: 0,
        block: -1,
    };
}

/// The primary's answer to one slice request.
#[derive(Debug, Clone)]
pub struct SliceAnswer {
    pub list: Vec<u8>,
    pub blocks: u64,
    pub last: Cursor,
    pub complete: bool,
    /// False under direct I/O: the page cache holds no relation data there.
    pub in_play: bool,
}

/// One standby's answer to one batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchResult {
    pub requested: u64,
    pub already_cached: u64,
    pub advised: u64,
    pub skipped: u64,
    /// Its memory headroom stopped the reading.
    pub limited: bool,
    pub in_play: bool,
    /// The standby's replay lag in bytes right after the call; None when it does not stream.
    pub replay_lag: Option<u64>,
}

/// A batch of a slice, queued for one candidate.
#[derive(Debug, Clone)]
pub struct Batch {
    pub pass: u64,
    /// The batch's list (a CCMB block list).
    pub list: Arc<Vec<u8>>,
    /// The last batch of its slice.
    pub ends_slice: bool,
    /// The last batch of its pass; then the pass had `Some(slices)` slices.
    pub ends_pass: Option<u32>,
}

/// What a candidate held of the primary's page cache in its last complete pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coverage {
    /// Resident blocks of the primary's relation files.
    pub primary_blocks: u64,
    /// Of those, the blocks the candidate held before this pass read anything.
    pub held_blocks: u64,
    /// Blocks its headroom kept it from reading.
    pub limited: bool,
}

impl Coverage {
    pub fn share(&self) -> f64 {
        if self.primary_blocks == 0 {
            1.0
        } else {
            self.held_blocks as f64 / self.primary_blocks as f64
        }
    }
}

/// A candidate's tally of the pass its batches belong to.
#[derive(Debug, Clone, Default)]
struct Tally {
    pass: u64,
    slices: u32,
    requested: u64,
    held: u64,
    advised: u64,
    limited: bool,
}

#[derive(Debug, Default)]
struct Candidate {
    queue: VecDeque<Batch>,
    tally: Tally,
    last: Option<Coverage>,
}

/// The tier's state, owned by the coordinator and shared with the standbys' tasks.
#[derive(Debug)]
pub struct OsTier {
    cursor: Cursor,
    pass: u64,
    slices: u32,
    /// Blocks advised in the pass before the current one, and in the current one so far.
    advised_previous: u64,
    advised_current: u64,
    pause: Duration,
    paused_until: Option<Instant>,
    /// The primary's own figure of its last complete pass.
    primary_blocks: Option<u64>,
    primary_current: u64,
    in_play: bool,
    candidates: HashMap<String, Candidate>,
}

impl OsTier {
    pub fn new(pause: Duration) -> Self {
        OsTier {
            cursor: Cursor::START,
            pass: 1,
            slices: 0,
            advised_previous: 1,
            advised_current: 0,
            pause,
            paused_until: None,
            primary_blocks: None,
            primary_current: 0,
            in_play: true,
            candidates: HashMap::new(),
        }
    }

    pub fn set_pause(&mut self, pause: Duration) {
        self.pause = pause;
    }

    /// Whether the primary's page cache is in play (false under direct I/O).
    pub fn in_play(&self) -> bool {
        self.in_play
    }

    /// The next slice's cursor, when one should be read now: not paused, and every
    /// candidate of `up` has read its queue. Starting a pass after one that read nothing
    /// starts the pause instead.
    pub fn wants_slice(&mut self, now: Instant, up: &[&str]) -> Option<Cursor> {
        if up.is_empty() {
            return None;
        }
        let behind = up.iter().any(|name| {
            self.candidates
                .get(*name)
                .is_some_and(|c| !c.queue.is_empty())
        });
        if behind {
            return None;
        }
        if self.slices == 0 {
            match self.paused_until {
                Some(until) if now < until => return None,
                Some(_) => self.paused_until = None,
                None if self.advised_previous == 0 => {
                    self.paused_until = Some(now + self.pause);
                    // Once the pause is over, a pass starts whatever the last one did.
                    self.advised_previous = 1;
                    return None;
                }
                None => {}
            }
        }
        Some(self.cursor)
    }

    /// Takes the primary's slice: its batches (`batches`, the slice's list split in file
    /// order) are queued for every candidate of `up`, and the cursor moves on.
    pub fn add_slice(&mut self, answer: &SliceAnswer, batches: Vec<Vec<u8>>, up: &[&str]) {
        self.in_play = answer.in_play;
        self.slices += 1;
        self.primary_current += answer.blocks;
        let ends_pass = answer.complete.then_some(self.slices);
        let count = batches.len();
        let batches: Vec<Arc<Vec<u8>>> = batches.into_iter().map(Arc::new).collect();
        for name in up {
            let candidate = self.candidates.entry((*name).to_string()).or_default();
            if candidate.queue.len() + count.max(1) > MAX_QUEUED_BATCHES {
                candidate.queue.clear();
                candidate.tally = Tally::default();
            }
            if count == 0 {
                // An empty slice still counts as one, or its pass would never complete.
                candidate.queue.push_back(Batch {
                    pass: self.pass,
                    list: Arc::new(Vec::new()),
                    ends_slice: true,
                    ends_pass,
                });
            }
            for (i, list) in batches.iter().enumerate() {
                let last = i + 1 == count;
                candidate.queue.push_back(Batch {
                    pass: self.pass,
                    list: Arc::clone(list),
                    ends_slice: last,
                    ends_pass: if last { ends_pass } else { None },
                });
            }
        }
        if answer.complete {
            self.primary_blocks = Some(self.primary_current);
            self.primary_current = 0;
            self.cursor = Cursor::START;
            self.pass += 1;
            self.slices = 0;
            self.advised_previous = self.advised_current;
            self.advised_current = 0;
        } else {
            self.cursor = answer.last;
        }
    }

    /// The next batch `name` has to read, if any (it stays queued until `done`).
    pub fn next_batch(&self, name: &str) -> Option<Batch> {
        self.candidates.get(name)?.queue.front().cloned()
    }

    /// Counts the answer to `name`'s first queued batch and takes it off the queue. An empty
    /// batch (an empty slice) is counted with a default result.
    pub fn done(&mut self, name: &str, result: PrefetchResult) {
        let Some(candidate) = self.candidates.get_mut(name) else {
            return;
        };
        let Some(batch) = candidate.queue.pop_front() else {
            return;
        };
        if candidate.tally.pass != batch.pass {
            candidate.tally = Tally {
                pass: batch.pass,
                ..Tally::default()
            };
        }
        let tally = &mut candidate.tally;
        tally.requested += result.requested;
        tally.held += result.already_cached;
        tally.advised += result.advised;
        tally.limited |= result.limited;
        if batch.ends_slice {
            tally.slices += 1;
        }
        // Reading blocked by the headroom cannot be confirmed by a pass at once.
        if !result.limited {
            if batch.pass == self.pass {
                self.advised_current += result.advised;
            } else {
                self.advised_previous += result.advised;
            }
        }
        if let Some(slices) = batch.ends_pass {
            if tally.slices == slices {
                candidate.last = Some(Coverage {
                    primary_blocks: tally.requested,
                    held_blocks: tally.held,
                    limited: tally.limited,
                });
            }
            candidate.tally = Tally::default();
        }
    }

    /// `name` is not up (down, silent, gone): its queue is dropped and its pass is partial.
    pub fn drop_queue(&mut self, name: &str) {
        if let Some(candidate) = self.candidates.get_mut(name) {
            candidate.queue.clear();
            candidate.tally = Tally::default();
        }
    }

    /// Starts over (a new primary): its page cache is another one.
    pub fn reset(&mut self) {
        *self = OsTier::new(self.pause);
    }

    /// `name`'s coverage in its last complete pass.
    pub fn coverage(&self, name: &str) -> Option<Coverage> {
        self.candidates.get(name)?.last
    }

    /// The primary's resident blocks in its last complete pass.
    pub fn primary_blocks(&self) -> Option<u64> {
        self.primary_blocks
    }

    /// The pass being read (1 for the first).
    #[cfg(test)]
    pub fn pass(&self) -> u64 {
        self.pass
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "a";
    const B: &str = "b";

    #[test]
    fn a_standbys_readers_come_first_from_the_configured_number_of_busy_sessions() {
        assert!(!readers_first(0, 1));
        assert!(readers_first(1, 1));
        assert!(!readers_first(2, 3));
        assert!(readers_first(3, 3));
        assert!(!readers_first(100, 0), "0: never waits");
    }

    fn slice(blocks: u64, complete: bool) -> SliceAnswer {
        SliceAnswer {
            list: Vec::new(),
            blocks,
            last: Cursor {
                spc: 1663,
                db: 5,
                rel: 16384,
                block: blocks as i64,
            },
            complete,
            in_play: true,
        }
    }

    fn result(requested: u64, held: u64, advised: u64) -> PrefetchResult {
        PrefetchResult {
            requested,
            already_cached: held,
            advised,
            in_play: true,
            ..PrefetchResult::default()
        }
    }

    /// Reads every batch queued for `name`, each answered by `answer`.
    fn read_all(tier: &mut OsTier, name: &str, answer: PrefetchResult) -> usize {
        let mut n = 0;
        while tier.next_batch(name).is_some() {
            tier.done(name, answer);
            n += 1;
        }
        n
    }

    #[test]
    fn a_pass_walks_the_slices_and_publishes_what_each_candidate_held() {
        let now = Instant::now();
        let mut tier = OsTier::new(Duration::from_secs(60));
        assert_eq!(tier.wants_slice(now, &[A, B]), Some(Cursor::START));
        tier.add_slice(&slice(100, false), vec![vec![1], vec![2]], &[A, B]);
        // Nothing more until both read their queue.
        assert_eq!(tier.wants_slice(now, &[A, B]), None);
        assert_eq!(read_all(&mut tier, A, result(50, 50, 0)), 2);
        assert_eq!(tier.wants_slice(now, &[A, B]), None);
        assert_eq!(read_all(&mut tier, B, result(50, 10, 40)), 2);
        let cursor = tier.wants_slice(now, &[A, B]).expect("the next slice");
        assert_eq!(
            cursor.block, 100,
            "the walk goes on after the last block examined"
        );
        assert!(tier.coverage(A).is_none(), "no pass is complete yet");
        tier.add_slice(&slice(20, true), vec![vec![3]], &[A, B]);
        read_all(&mut tier, A, result(20, 20, 0));
        read_all(&mut tier, B, result(20, 0, 20));
        assert_eq!(tier.primary_blocks(), Some(120));
        assert_eq!(
            tier.coverage(A),
            Some(Coverage {
                primary_blocks: 120,
                held_blocks: 120,
                limited: false
            })
        );
        assert_eq!(tier.coverage(B).map(|c| c.held_blocks), Some(20));
        assert!((tier.coverage(B).unwrap().share() - 20.0 / 120.0).abs() < 1e-9);
        assert_eq!(tier.pass(), 2);
    }

    #[test]
    fn a_pass_that_read_is_followed_at_once_one_that_read_nothing_by_the_pause() {
        let now = Instant::now();
        let pause = Duration::from_secs(60);
        let mut tier = OsTier::new(pause);
        tier.wants_slice(now, &[A]).unwrap();
        tier.add_slice(&slice(10, true), vec![vec![1]], &[A]);
        read_all(&mut tier, A, result(10, 0, 10));
        assert_eq!(
            tier.wants_slice(now, &[A]),
            Some(Cursor::START),
            "a pass that read is confirmed by the next at once"
        );
        tier.add_slice(&slice(10, true), vec![vec![1]], &[A]);
        read_all(&mut tier, A, result(10, 10, 0));
        assert_eq!(tier.coverage(A).unwrap().share(), 1.0);
        assert_eq!(tier.wants_slice(now, &[A]), None, "settled: the pause");
        assert_eq!(tier.wants_slice(now + pause / 2, &[A]), None);
        assert_eq!(tier.wants_slice(now + pause, &[A]), Some(Cursor::START));
    }

    #[test]
    fn a_candidate_that_missed_slices_publishes_nothing_for_that_pass() {
        let now = Instant::now();
        let mut tier = OsTier::new(Duration::from_secs(60));
        tier.wants_slice(now, &[A]).unwrap();
        tier.add_slice(&slice(10, false), vec![vec![1]], &[A]);
        read_all(&mut tier, A, result(10, 10, 0));
        // B comes up in the middle of the pass.
        tier.wants_slice(now, &[A, B]).unwrap();
        tier.add_slice(&slice(10, true), vec![vec![2]], &[A, B]);
        read_all(&mut tier, A, result(10, 10, 0));
        read_all(&mut tier, B, result(10, 10, 0));
        assert_eq!(tier.coverage(A).map(|c| c.primary_blocks), Some(20));
        assert!(tier.coverage(B).is_none(), "half a pass is no coverage");
        // Its next pass is whole.
        assert_eq!(tier.wants_slice(now, &[A, B]), None, "nothing read: pause");
        let later = now + Duration::from_secs(61);
        tier.wants_slice(later, &[A, B]).unwrap();
        tier.add_slice(&slice(20, true), vec![vec![1]], &[A, B]);
        read_all(&mut tier, B, result(20, 15, 5));
        assert_eq!(tier.coverage(B).map(|c| c.held_blocks), Some(15));
    }

    #[test]
    fn a_candidate_that_is_down_is_not_waited_for() {
        let now = Instant::now();
        let mut tier = OsTier::new(Duration::from_secs(60));
        tier.wants_slice(now, &[A, B]).unwrap();
        tier.add_slice(&slice(10, false), vec![vec![1]], &[A, B]);
        read_all(&mut tier, A, result(10, 10, 0));
        // B stopped answering: the next slice is read without it, and its queue is gone.
        tier.drop_queue(B);
        assert!(tier.wants_slice(now, &[A]).is_some());
        assert!(tier.next_batch(B).is_none());
    }

    #[test]
    fn an_empty_slice_still_ends_its_pass() {
        let now = Instant::now();
        let mut tier = OsTier::new(Duration::from_secs(60));
        tier.wants_slice(now, &[A]).unwrap();
        tier.add_slice(&slice(0, true), Vec::new(), &[A]);
        assert!(tier.next_batch(A).is_some());
        tier.done(A, PrefetchResult::default());
        assert_eq!(
            tier.coverage(A),
            Some(Coverage {
                primary_blocks: 0,
                held_blocks: 0,
                limited: false
            })
        );
        assert_eq!(tier.coverage(A).unwrap().share(), 1.0, "nothing to hold");
    }

    #[test]
    fn reading_stopped_by_the_headroom_is_shown_and_does_not_spin() {
        let now = Instant::now();
        let mut tier = OsTier::new(Duration::from_secs(60));
        tier.wants_slice(now, &[A]).unwrap();
        tier.add_slice(&slice(10, true), vec![vec![1]], &[A]);
        tier.done(
            A,
            PrefetchResult {
                requested: 10,
                already_cached: 2,
                advised: 3,
                skipped: 5,
                limited: true,
                in_play: true,
                replay_lag: None,
            },
        );
        assert!(tier.coverage(A).unwrap().limited);
        assert_eq!(
            tier.wants_slice(now, &[A]),
            None,
            "a pass its headroom stopped is not repeated at once"
        );
    }

    #[test]
    fn a_candidate_far_behind_gives_up_its_pass() {
        let now = Instant::now();
        let mut tier = OsTier::new(Duration::from_secs(60));
        tier.wants_slice(now, &[A]).unwrap();
        let many: Vec<Vec<u8>> = (0..MAX_QUEUED_BATCHES).map(|i| vec![i as u8]).collect();
        tier.add_slice(&slice(10, false), many.clone(), &[A]);
        tier.add_slice(&slice(10, false), vec![vec![1]], &[A]);
        assert_eq!(
            tier.candidates[A].queue.len(),
            1,
            "the old queue was dropped"
        );
    }

    #[test]
    fn a_new_primary_starts_over() {
        let now = Instant::now();
        let mut tier = OsTier::new(Duration::from_secs(60));
        tier.wants_slice(now, &[A]).unwrap();
        tier.add_slice(&slice(10, false), vec![vec![1]], &[A]);
        tier.reset();
        assert!(tier.next_batch(A).is_none());
        assert_eq!(tier.wants_slice(now, &[A]), Some(Cursor::START));
        assert_eq!(tier.pass(), 1);
    }
}
