//! The arithmetic of pg_ccm's logical WAL cache, free of PostgreSQL so that `cargo test`
//! covers it in milliseconds.
//!
//! The cache holds the newest `size` WAL pages (XLOG_BLCKSZ, 8 kB) behind the flush
//! position, first-in first-out: a page enters when it is written and leaves when the
//! window has moved `size` pages past it. The background worker maps those pages from the
//! segment files and locks them in memory; this crate says *which* pages (`Window`,
//! `segment_pieces`), how much of it to lock and in which steps (`lock_target`,
//! `next_lock_step`, `capped_cache_pages`), and how a replication slot's progress turns into
//! hits and misses (`SlotCounter`). `memory` says how much memory the server may use: the
//! host's RAM, or its cgroup's memory limit if smaller; and how much of it is still free
//! (`free_memory`, for ccm_os_prefetch's budget).

use std::ops::Range;

pub mod memory;

pub use memory::{free_memory, usable_memory};

/// WAL page size (PostgreSQL's XLOG_BLCKSZ; the extension asserts it matches).
pub const WAL_PAGE: u64 = 8192;

/// Smallest positive cache size, in pages; smaller positive settings are raised to it
/// (as Aurora's `rds.logical_wal_cache` does).
pub const MIN_CACHE_PAGES: i32 = 4;

/// The cache size the server uses for a `ccm.logical_wal_cache` setting: 0 is off,
/// 1 to 3 become 4, negative values (rejected by the GUC itself) count as off.
pub fn effective_cache_pages(setting: i32) -> i32 {
    match setting {
        i32::MIN..=0 => 0,
        1..MIN_CACHE_PAGES => MIN_CACHE_PAGES,
        _ => setting,
    }
}

/// A quarter of the server's memory (`memory::usable_memory`: the host's RAM, or its
/// cgroup's memory limit if smaller): the largest cache the worker uses, whatever the setting
/// (with CAP_IPC_LOCK nothing else bounds what it locks).
pub const PHYSICAL_MEMORY_DIVISOR: u64 = 4;

/// The cache size in pages for a server with `memory` bytes of memory
/// (`memory::usable_memory`): `pages`, at most a quarter of the memory (but never below the
/// minimum size); 0 stays 0 (off), and an unknown memory size (0) caps nothing.
pub fn capped_cache_pages(pages: u64, memory: u64) -> u64 {
    if pages == 0 || memory == 0 {
        return pages;
    }
    let cap = (memory / PHYSICAL_MEMORY_DIVISOR / WAL_PAGE).max(MIN_CACHE_PAGES as u64);
    pages.min(cap)
}

/// Rounds down to a multiple of `granule` (a power of two).
pub fn align_down(value: u64, granule: u64) -> u64 {
    debug_assert!(granule.is_power_of_two());
    value & !(granule - 1)
}

/// Rounds up to a multiple of `granule` (a power of two), saturating.
pub fn align_up(value: u64, granule: u64) -> u64 {
    align_down(value.saturating_add(granule - 1), granule)
}

/// The unit in which pages are locked, unlocked and checked for residency: the OS page, but
/// at least a WAL page. `mlock`/`munlock` act on whole OS pages and `mincore` wants an
/// OS-page-aligned address, so with 64 kB OS pages (some aarch64 kernels) every range the
/// worker passes them must be aligned to 64 kB, not to 8 kB. None when the OS page size is not
/// a power of two or does not divide the segment size (the worker then does not lock).
pub fn lock_granule(os_page: u64, segment_size: u64) -> Option<u64> {
    let granule = os_page.max(WAL_PAGE);
    (os_page.is_power_of_two() && segment_size.is_power_of_two() && granule <= segment_size)
        .then_some(granule)
}

fn page_floor(lsn: u64) -> u64 {
    lsn - lsn % WAL_PAGE
}

fn page_ceil(lsn: u64) -> u64 {
    page_floor(lsn.saturating_add(WAL_PAGE - 1))
}

/// A page-aligned WAL range `[start, end)`, as LSNs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub start: u64,
    pub end: u64,
}

impl Window {
    pub const EMPTY: Window = Window { start: 0, end: 0 };

    /// The newest `pages` pages up to and including the page that holds `flush - 1`.
    pub fn newest(flush: u64, pages: u64) -> Window {
        let end = page_ceil(flush);
        Window {
            start: end.saturating_sub(pages.saturating_mul(WAL_PAGE)),
            end,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.start >= self.end
    }

    pub fn pages(&self) -> u64 {
        self.end.saturating_sub(self.start) / WAL_PAGE
    }

    pub fn bytes(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }

    /// The newest part of the window that fits in `budget` bytes (whole pages).
    pub fn newest_part(&self, budget: u64) -> Window {
        if self.is_empty() {
            return Window::EMPTY;
        }
        let start = self.end.saturating_sub(page_floor(budget)).max(self.start);
        Window {
            start,
            end: self.end,
        }
    }

    /// The same window without its pages before `lsn` (rounded up to a page).
    pub fn starting_at_or_after(&self, lsn: u64) -> Window {
        let start = self.start.max(page_ceil(lsn)).min(self.end);
        Window {
            start,
            end: self.end,
        }
    }

    pub fn contains_page(&self, page_start: u64) -> bool {
        self.start <= page_start && page_start < self.end
    }

    /// The part of both windows (EMPTY when they do not overlap).
    pub fn intersect(&self, other: &Window) -> Window {
        let start = self.start.max(other.start);
        let end = self.end.min(other.end);
        if start < end {
            Window { start, end }
        } else {
            Window::EMPTY
        }
    }

    /// The parts of `self` not in `other`: zero, one or two ranges, oldest first.
    pub fn minus(&self, other: &Window) -> Vec<Window> {
        if self.is_empty() {
            return Vec::new();
        }
        if other.is_empty() || other.end <= self.start || other.start >= self.end {
            return vec![*self];
        }
        let mut parts = Vec::with_capacity(2);
        if self.start < other.start {
            parts.push(Window {
                start: self.start,
                end: other.start,
            });
        }
        if other.end < self.end {
            parts.push(Window {
                start: other.end,
                end: self.end,
            });
        }
        parts
    }
}

/// What to keep locked of the `mapped` window with a lock budget of `budget` bytes: the
/// window rounded out to whole `granule`s (see `lock_granule`), then its newest part that fits
/// in the budget. Rounding out never leaves the segments of `mapped`, since segment
/// boundaries are multiples of the granule; the OS page holding the flush position is locked
/// whole, including the part WAL has not reached yet (the segment file exists in full).
pub fn lock_target(mapped: Window, budget: u64, granule: u64) -> Window {
    if mapped.is_empty() {
        return Window::EMPTY;
    }
    let end = align_up(mapped.end, granule);
    let start =
        align_down(mapped.start, granule).max(end.saturating_sub(align_down(budget, granule)));
    if start < end {
        Window { start, end }
    } else {
        Window::EMPTY
    }
}

/// The next range to lock, at most `step` bytes within one segment, or None when `locked`
/// covers `target`. `locked` is what is locked now: a contiguous part of `target` (or
/// EMPTY). Newer pages come first: while `locked` does not reach the end of `target`, the
/// range right after it (oldest first, so that `locked` stays contiguous); then the range
/// right before it, newest first; with nothing locked yet, the newest range of `target`.
/// Locking `[a, b)` and widening `locked` to include it keeps `locked` contiguous. With
/// `target`, `locked` and `step` multiples of `granule` and the segment size a multiple of
/// the granule, every range is granule-aligned.
pub fn next_lock_step(
    locked: Window,
    target: Window,
    step: u64,
    segment_size: u64,
) -> Option<Window> {
    assert!(step > 0 && segment_size.is_power_of_two());
    // The range of at most `step` bytes that ends at `end`, within the target and one segment.
    let backwards = |end: u64| Window {
        start: end
            .saturating_sub(step)
            .max(target.start)
            .max(align_down(end - 1, segment_size)),
        end,
    };
    if target.is_empty() {
        return None;
    }
    let locked = locked.intersect(&target);
    if locked.is_empty() {
        return Some(backwards(target.end));
    }
    if locked.end < target.end {
        let start = locked.end;
        let end = target
            .end
            .min(start.saturating_add(step))
            .min(align_down(start, segment_size) + segment_size);
        return Some(Window { start, end });
    }
    if locked.start > target.start {
        return Some(backwards(locked.start));
    }
    None
}

/// `locked` widened by a range `next_lock_step` returned for it.
pub fn widen(locked: Window, step: Window) -> Window {
    if locked.is_empty() {
        return step;
    }
    debug_assert!(
        step.start <= locked.end && locked.start <= step.end,
        "not adjacent"
    );
    Window {
        start: locked.start.min(step.start),
        end: locked.end.max(step.end),
    }
}

/// Start of the held window: the start of the resident window as of the last residency
/// check (`resident_from`: just after the newest page then found evicted among the pages not
/// locked), corrected for what was locked since. Locked pages are resident, so if no evicted
/// page was found after `locked`, everything from `locked.start` on is held even if the last
/// check found an evicted page that has since been locked (locking reads it back).
pub fn held_start(resident_from: u64, locked: Window) -> u64 {
    if !locked.is_empty() && resident_from <= locked.end {
        resident_from.min(locked.start)
    } else {
        resident_from
    }
}

/// How long to wait before trying `mlock` again after the `failures`-th failure in a row:
/// 1 s, doubling, at most a minute.
pub fn lock_retry_delay_ms(failures: u32) -> u64 {
    const FIRST_MS: u64 = 1000;
    const MAX_MS: u64 = 60_000;
    (FIRST_MS << failures.saturating_sub(1).min(16)).min(MAX_MS)
}

/// One segment's share of a WAL range: segment number and byte offsets within the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentPiece {
    pub segno: u64,
    pub offsets: Range<u64>,
}

/// Splits a range into per-segment pieces, oldest first.
pub fn segment_pieces(range: Window, segment_size: u64) -> Vec<SegmentPiece> {
    assert!(segment_size.is_power_of_two() && segment_size >= WAL_PAGE);
    let mut pieces = Vec::new();
    let mut at = range.start;
    while at < range.end {
        let segno = at / segment_size;
        let segment_start = segno * segment_size;
        let until = range.end.min(segment_start + segment_size);
        pieces.push(SegmentPiece {
            segno,
            offsets: at - segment_start..until - segment_start,
        });
        at = until;
    }
    pieces
}

/// The segment numbers a range touches, oldest first.
pub fn segments_of(range: Window, segment_size: u64) -> Range<u64> {
    if range.is_empty() {
        return 0..0;
    }
    range.start / segment_size..(range.end - 1) / segment_size + 1
}

/// The timeline and segment number of a WAL segment file, from its name (24 upper-case hex
/// digits, TTTTTTTTXXXXXXXXYYYYYYYY, as PostgreSQL's XLogFromFileName() reads it), or of the
/// same with `.partial` (the last segment of an old timeline that a promotion renamed); None
/// for anything else (`.history` files, archive status, temporary files).
pub fn segment_file(name: &str, segment_size: u64) -> Option<(u32, u64)> {
    let digits = name.strip_suffix(".partial").unwrap_or(name);
    if digits.len() != 24
        || !digits
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b))
    {
        return None;
    }
    let segments_per_xlogid = 0x1_0000_0000 / segment_size.max(1);
    let timeline = u32::from_str_radix(&digits[..8], 16).ok()?;
    let high = u64::from_str_radix(&digits[8..16], 16).ok()?;
    let low = u64::from_str_radix(&digits[16..], 16).ok()?;
    (low < segments_per_xlogid).then_some((timeline, high * segments_per_xlogid + low))
}

/// The WAL position below which nobody will read a node's WAL again: the lowest of the
/// position its own work has reached (`position`: replay on a standby, the flush on a
/// primary), the positions WAL is kept from for a later reader (`kept_from`: where decoding
/// through a logical slot would start, where the logical WAL cache's window starts, which
/// can be 0; None for none) and what each connected walsender has sent (`walsenders_sent`).
/// None while a walsender has sent nothing yet: it may start anywhere.
pub fn read_by_everyone(
    position: u64,
    kept_from: impl IntoIterator<Item = Option<u64>>,
    walsenders_sent: impl IntoIterator<Item = u64>,
) -> Option<u64> {
    let mut limit = position;
    for kept in kept_from.into_iter().flatten() {
        limit = limit.min(kept);
    }
    for sent in walsenders_sent {
        if sent == 0 {
            return None;
        }
        limit = limit.min(sent);
    }
    Some(limit)
}

/// PostgreSQL's XLogFileName(): timeline, then the segment number split at 4 GB of WAL.
pub fn wal_file_name(timeline: u32, segno: u64, segment_size: u64) -> String {
    let segments_per_xlogid = 0x1_0000_0000 / segment_size;
    format!(
        "{:08X}{:08X}{:08X}",
        timeline,
        segno / segments_per_xlogid,
        segno % segments_per_xlogid
    )
}

/// Hits and misses of one accounting step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Consumed {
    pub hits: u64,
    pub misses: u64,
}

/// What a replication slot has consumed, in WAL pages.
///
/// A slot consumes a page when its decoding position first passes the page's start: the
/// page holding position `p - 1` and every page before it have been read. Each page counts
/// once, however often decoding re-reads it (a restarted walsender decodes again from the
/// slot's restart_lsn). A page is a *hit* when the cache held it at the start of the
/// interval in which the slot consumed it (FIFO: a page the cache holds at some moment has
/// been held since it was written), and a *miss* otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotCounter {
    /// Pages `[0, consumed_pages)` count as consumed; 0 until the slot was first seen.
    pub consumed_pages: u64,
    pub hits: u64,
    pub misses: u64,
}

impl SlotCounter {
    /// Starts counting at a slot's current position; what it read before is not counted.
    pub fn starting_at(position: u64) -> SlotCounter {
        SlotCounter {
            consumed_pages: page_ceil(position) / WAL_PAGE,
            hits: 0,
            misses: 0,
        }
    }

    /// Accounts for the slot having reached `position`. `held` is the window the cache
    /// held at the start of the interval (EMPTY when it held nothing); pages at or after its
    /// start count as hits, since everything newer than the window's start was either in it
    /// or written afterwards, and so held from its writing until it was consumed.
    pub fn advance(&mut self, position: u64, held: Window) -> Consumed {
        let reached = page_ceil(position) / WAL_PAGE;
        if reached <= self.consumed_pages {
            return Consumed::default();
        }
        let first = self.consumed_pages;
        let consumed = reached - first;
        let hits = if held.is_empty() {
            0
        } else {
            reached.saturating_sub(first.max(held.start / WAL_PAGE))
        };
        let step = Consumed {
            hits,
            misses: consumed - hits,
        };
        self.consumed_pages = reached;
        self.hits += step.hits;
        self.misses += step.misses;
        step
    }

    pub fn reset_counts(&mut self) {
        self.hits = 0;
        self.misses = 0;
    }

    pub fn blocks_read(&self) -> u64 {
        self.hits + self.misses
    }
}

/// Aurora's `hit_rate` column: `cache_hit / blks_read` as text with two decimals and a
/// percent sign (`100.00%`); None (SQL NULL) before the slot has read anything.
pub fn hit_rate_text(hits: u64, blocks_read: u64) -> Option<String> {
    if blocks_read == 0 {
        return None;
    }
    // Hundredths of a percent, rounded down, so that 100.00% means not a single miss.
    let hundredths = u128::from(hits) * 10_000 / u128::from(blocks_read);
    Some(format!("{}.{:02}%", hundredths / 100, hundredths % 100))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEG: u64 = 16 * 1024 * 1024;

    #[test]
    fn small_settings_are_raised_to_four_pages() {
        assert_eq!(effective_cache_pages(0), 0);
        assert_eq!(effective_cache_pages(-1), 0);
        assert_eq!(effective_cache_pages(1), 4);
        assert_eq!(effective_cache_pages(3), 4);
        assert_eq!(effective_cache_pages(4), 4);
        assert_eq!(effective_cache_pages(2048), 2048);
    }

    #[test]
    fn window_ends_with_the_page_holding_the_flush_position() {
        let w = Window::newest(10 * WAL_PAGE + 100, 4);
        assert_eq!(
            w,
            Window {
                start: 7 * WAL_PAGE,
                end: 11 * WAL_PAGE
            }
        );
        assert_eq!(w.pages(), 4);
        let aligned = Window::newest(10 * WAL_PAGE, 4);
        assert_eq!(
            aligned,
            Window {
                start: 6 * WAL_PAGE,
                end: 10 * WAL_PAGE
            }
        );
        // Less WAL than the cache size: the window starts at 0.
        assert_eq!(
            Window::newest(WAL_PAGE + 1, 2048),
            Window {
                start: 0,
                end: 2 * WAL_PAGE
            }
        );
    }

    #[test]
    fn newest_part_keeps_whole_pages_of_the_head() {
        let w = Window {
            start: 0,
            end: 100 * WAL_PAGE,
        };
        assert_eq!(
            w.newest_part(8 * 1024 * 1024),
            Window {
                start: 0,
                end: 100 * WAL_PAGE
            }
        );
        assert_eq!(
            w.newest_part(10 * WAL_PAGE + 5),
            Window {
                start: 90 * WAL_PAGE,
                end: 100 * WAL_PAGE
            }
        );
        assert!(w.newest_part(0).is_empty());
        assert!(Window::EMPTY.newest_part(u64::MAX).is_empty());
    }

    #[test]
    fn minus_gives_the_pieces_to_lock_and_unlock() {
        let old = Window {
            start: 0,
            end: 10 * WAL_PAGE,
        };
        let new = Window {
            start: 3 * WAL_PAGE,
            end: 12 * WAL_PAGE,
        };
        assert_eq!(
            old.minus(&new),
            vec![Window {
                start: 0,
                end: 3 * WAL_PAGE
            }]
        );
        assert_eq!(
            new.minus(&old),
            vec![Window {
                start: 10 * WAL_PAGE,
                end: 12 * WAL_PAGE
            }]
        );
        let inner = Window {
            start: 2 * WAL_PAGE,
            end: 4 * WAL_PAGE,
        };
        assert_eq!(old.minus(&inner).len(), 2);
        assert_eq!(old.minus(&Window::EMPTY), vec![old]);
        assert!(Window::EMPTY.minus(&old).is_empty());
        assert!(old.minus(&old).is_empty());
    }

    #[test]
    fn pieces_split_at_segment_boundaries() {
        let range = Window {
            start: SEG - 2 * WAL_PAGE,
            end: SEG + WAL_PAGE,
        };
        assert_eq!(
            segment_pieces(range, SEG),
            vec![
                SegmentPiece {
                    segno: 0,
                    offsets: SEG - 2 * WAL_PAGE..SEG
                },
                SegmentPiece {
                    segno: 1,
                    offsets: 0..WAL_PAGE
                },
            ]
        );
        assert_eq!(segments_of(range, SEG), 0..2);
        assert_eq!(
            segments_of(
                Window {
                    start: SEG,
                    end: 2 * SEG
                },
                SEG
            ),
            1..2
        );
        assert!(segment_pieces(Window::EMPTY, SEG).is_empty());
    }

    #[test]
    fn file_names_match_postgres() {
        // 16 MB segments: 256 per 4 GB "xlogid".
        assert_eq!(wal_file_name(1, 1, SEG), "000000010000000000000001");
        assert_eq!(wal_file_name(2, 0x1FF, SEG), "0000000200000001000000FF");
        // 1 GB segments: 4 per xlogid.
        assert_eq!(wal_file_name(0xA, 5, 1 << 30), "0000000A0000000100000001");
    }

    #[test]
    fn segment_files_tell_their_timeline_and_number_and_nothing_else_does() {
        assert_eq!(segment_file("000000010000000000000001", SEG), Some((1, 1)));
        assert_eq!(
            segment_file("0000000A0000000100000001", SEG),
            Some((10, 0x101))
        );
        assert_eq!(
            segment_file("000000010000000000000003.partial", SEG),
            Some((1, 3))
        );
        assert_eq!(
            segment_file(&wal_file_name(7, 0x1FF, SEG), SEG),
            Some((7, 0x1FF))
        );
        // 1 GB segments: four per 4 GB of WAL, so a low part of 4 is no segment.
        assert_eq!(
            segment_file("000000010000000200000003", 1 << 30),
            Some((1, 11))
        );
        assert_eq!(segment_file("000000010000000200000004", 1 << 30), None);
        for other in [
            "00000002.history",
            "archive_status",
            "xlogtemp.1234",
            "000000010000000000000003.ready",
            "0000000100000000000000",
            "0000000100000000000000011",
            "00000001000000000000000g",
            "00000001000000000000000a",
            "",
        ] {
            assert_eq!(segment_file(other, SEG), None, "{other}");
        }
    }

    #[test]
    fn wal_is_read_by_everyone_below_the_slowest_reader() {
        assert_eq!(read_by_everyone(900, [None, None], []), Some(900));
        assert_eq!(
            read_by_everyone(900, [Some(400), None], []),
            Some(400),
            "a logical slot keeps its WAL"
        );
        assert_eq!(
            read_by_everyone(900, [None, Some(600)], []),
            Some(600),
            "so does the logical WAL cache"
        );
        assert_eq!(
            read_by_everyone(900, [None, Some(0)], []),
            Some(0),
            "a cache window larger than the WAL written keeps all of it"
        );
        assert_eq!(
            read_by_everyone(900, [None, None], [950, 700]),
            Some(700),
            "so does a walsender"
        );
        assert_eq!(
            read_by_everyone(300, [Some(400), Some(500)], [950]),
            Some(300)
        );
        assert_eq!(
            read_by_everyone(900, [Some(400), None], [950, 0]),
            None,
            "a walsender that sent nothing yet may start anywhere"
        );
    }

    #[test]
    fn a_slot_that_keeps_up_hits() {
        let mut slot = SlotCounter::starting_at(100 * WAL_PAGE);
        let held = Window {
            start: 90 * WAL_PAGE,
            end: 101 * WAL_PAGE,
        };
        assert_eq!(
            slot.advance(100 * WAL_PAGE + 10, held),
            Consumed { hits: 1, misses: 0 }
        );
        // Same page again: nothing new.
        assert_eq!(
            slot.advance(100 * WAL_PAGE + 500, held),
            Consumed::default()
        );
        assert_eq!(
            slot.advance(105 * WAL_PAGE, held),
            Consumed { hits: 4, misses: 0 }
        );
        assert_eq!(slot.blocks_read(), 5);
        // Going back (a walsender restarting at restart_lsn) counts nothing.
        assert_eq!(slot.advance(50 * WAL_PAGE, held), Consumed::default());
    }

    #[test]
    fn a_slot_behind_the_window_misses_what_left_it() {
        let mut slot = SlotCounter::starting_at(0);
        let held = Window {
            start: 1000 * WAL_PAGE,
            end: 1100 * WAL_PAGE,
        };
        assert_eq!(
            slot.advance(1100 * WAL_PAGE, held),
            Consumed {
                hits: 100,
                misses: 1000
            }
        );
        assert_eq!(slot.hits, 100);
        assert_eq!(slot.misses, 1000);
        let mut cold = SlotCounter::starting_at(0);
        assert_eq!(
            cold.advance(3 * WAL_PAGE, Window::EMPTY),
            Consumed { hits: 0, misses: 3 }
        );
    }

    #[test]
    fn hit_rate_is_aurora_text() {
        assert_eq!(hit_rate_text(24, 24).as_deref(), Some("100.00%"));
        assert_eq!(hit_rate_text(0, 7).as_deref(), Some("0.00%"));
        assert_eq!(hit_rate_text(1, 3).as_deref(), Some("33.33%"));
        assert_eq!(hit_rate_text(2, 3).as_deref(), Some("66.66%"));
        assert_eq!(hit_rate_text(19999, 20000).as_deref(), Some("99.99%"));
        assert_eq!(hit_rate_text(199_999, 200_000).as_deref(), Some("99.99%"));
        assert_eq!(hit_rate_text(0, 0), None);
        assert_eq!(
            hit_rate_text(u64::MAX, u64::MAX).as_deref(),
            Some("100.00%")
        );
    }

    const GB: u64 = 1 << 30;
    const MB: u64 = 1 << 20;

    #[test]
    fn the_cache_is_at_most_a_quarter_of_physical_memory() {
        // 16 GB of RAM: at most 4 GB of WAL (524288 pages).
        assert_eq!(capped_cache_pages(4 * 1024 * 1024, 16 * GB), 524_288);
        assert_eq!(capped_cache_pages(2048, 16 * GB), 2048);
        assert_eq!(capped_cache_pages(524_288, 16 * GB), 524_288);
        assert_eq!(capped_cache_pages(524_289, 16 * GB), 524_288);
        // Off stays off; an unknown RAM size caps nothing.
        assert_eq!(capped_cache_pages(0, 16 * GB), 0);
        assert_eq!(capped_cache_pages(4 * 1024 * 1024, 0), 4 * 1024 * 1024);
        // A tiny host still gets the minimum cache.
        assert_eq!(capped_cache_pages(2048, 64 * 1024), MIN_CACHE_PAGES as u64);
        assert_eq!(capped_cache_pages(2, 64 * 1024), 2);
    }

    #[test]
    fn granules_are_os_pages_but_at_least_wal_pages() {
        assert_eq!(lock_granule(4096, SEG), Some(WAL_PAGE));
        assert_eq!(lock_granule(16384, SEG), Some(16384));
        assert_eq!(lock_granule(65536, SEG), Some(65536));
        assert_eq!(lock_granule(65536, MB), Some(65536));
        assert_eq!(lock_granule(2 * MB, MB), None);
        assert_eq!(lock_granule(12288, SEG), None);
        assert_eq!(align_down(70_000, 65536), 65536);
        assert_eq!(align_up(70_000, 65536), 131_072);
        assert_eq!(align_up(65536, 65536), 65536);
        assert_eq!(align_up(u64::MAX, 4096), u64::MAX - 4095);
    }

    #[test]
    fn intersections() {
        let a = Window { start: 10, end: 20 };
        assert_eq!(
            a.intersect(&Window { start: 15, end: 30 }),
            Window { start: 15, end: 20 }
        );
        assert_eq!(
            a.intersect(&Window { start: 0, end: 12 }),
            Window { start: 10, end: 12 }
        );
        assert!(a.intersect(&Window { start: 20, end: 30 }).is_empty());
        assert!(a.intersect(&Window::EMPTY).is_empty());
    }

    #[test]
    fn the_lock_target_is_whole_os_pages_within_the_budget() {
        let mapped = Window {
            start: SEG + 3 * WAL_PAGE,
            end: SEG + 100 * WAL_PAGE,
        };
        // 4 kB OS pages: the granule is a WAL page, as before.
        assert_eq!(lock_target(mapped, u64::MAX, WAL_PAGE), mapped);
        assert_eq!(
            lock_target(mapped, 10 * WAL_PAGE + 5, WAL_PAGE),
            Window {
                start: SEG + 90 * WAL_PAGE,
                end: SEG + 100 * WAL_PAGE
            }
        );
        // 64 kB OS pages (8 WAL pages): rounded out to whole OS pages.
        let k64 = 65536;
        assert_eq!(
            lock_target(mapped, u64::MAX, k64),
            Window {
                start: SEG,
                end: SEG + 104 * WAL_PAGE
            }
        );
        // The budget counts whole OS pages: 512 kB + 5 bytes is 8 of them.
        assert_eq!(
            lock_target(mapped, MB / 2 + 5, k64),
            Window {
                start: SEG + 104 * WAL_PAGE - MB / 2,
                end: SEG + 104 * WAL_PAGE
            }
        );
        assert!(lock_target(mapped, k64 - 1, k64).is_empty());
        assert!(lock_target(Window::EMPTY, u64::MAX, k64).is_empty());
    }

    #[test]
    fn locking_starts_with_the_newest_step_and_extends_backwards() {
        let step = 4 * MB;
        let target = Window {
            start: SEG - 6 * MB,
            end: 2 * SEG + 5 * MB,
        };
        let first = next_lock_step(Window::EMPTY, target, step, SEG).unwrap();
        assert_eq!(
            first,
            Window {
                start: 2 * SEG + MB,
                end: 2 * SEG + 5 * MB
            }
        );
        let locked = widen(Window::EMPTY, first);
        // The next one stops at the segment boundary.
        let second = next_lock_step(locked, target, step, SEG).unwrap();
        assert_eq!(
            second,
            Window {
                start: 2 * SEG,
                end: 2 * SEG + MB
            }
        );
        let locked = widen(locked, second);
        assert_eq!(
            next_lock_step(locked, target, step, SEG),
            Some(Window {
                start: 2 * SEG - step,
                end: 2 * SEG
            })
        );
        // New WAL: the head is locked first, forwards, then the rest backwards.
        let moved = Window {
            start: target.start,
            end: target.end + 2 * WAL_PAGE,
        };
        assert_eq!(
            next_lock_step(locked, moved, step, SEG),
            Some(Window {
                start: target.end,
                end: moved.end
            })
        );
        // All locked: nothing to do.
        assert_eq!(next_lock_step(target, target, step, SEG), None);
        assert_eq!(
            next_lock_step(Window::EMPTY, Window::EMPTY, step, SEG),
            None
        );
    }

    #[test]
    fn locked_pages_count_as_held_unless_a_newer_page_was_evicted() {
        let locked = Window {
            start: 100 * WAL_PAGE,
            end: 200 * WAL_PAGE,
        };
        // Resident from before the locked part: held from there.
        assert_eq!(held_start(50 * WAL_PAGE, locked), 50 * WAL_PAGE);
        // The evicted page found by the last check has been locked since.
        assert_eq!(held_start(150 * WAL_PAGE, locked), 100 * WAL_PAGE);
        assert_eq!(held_start(200 * WAL_PAGE, locked), 100 * WAL_PAGE);
        // A page newer than the locked part was evicted: the locked pages are not held.
        assert_eq!(held_start(201 * WAL_PAGE, locked), 201 * WAL_PAGE);
        assert_eq!(held_start(42, Window::EMPTY), 42);
    }

    #[test]
    fn lock_retries_back_off_to_a_minute() {
        let delays: Vec<u64> = (1..=9).map(lock_retry_delay_ms).collect();
        assert_eq!(
            delays,
            [1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000, 60000]
        );
        assert_eq!(lock_retry_delay_ms(u32::MAX), 60_000);
        assert_eq!(lock_retry_delay_ms(0), 1000);
    }

    proptest! {
        #[test]
        fn lock_steps_cover_the_target_exactly(
            start_granules in 0u64..100_000,
            len_granules in 0u64..20_000,
            budget_granules in 0u64..30_000,
            shift in 0u32..4,
            step_granules in 1u64..600,
        ) {
            let granule = WAL_PAGE << shift; // 8 kB to 64 kB
            let mapped = Window {
                start: start_granules * WAL_PAGE,
                end: (start_granules + len_granules) * WAL_PAGE,
            };
            let target = lock_target(mapped, budget_granules * granule, granule);
            prop_assert_eq!(target.start % granule, 0);
            prop_assert_eq!(target.end % granule, 0);
            prop_assert!(target.bytes() <= budget_granules * granule);
            if !target.is_empty() {
                prop_assert!(target.start / SEG >= mapped.start / SEG);
                prop_assert!((target.end - 1) / SEG <= (mapped.end - 1) / SEG);
                prop_assert!(target.end >= mapped.end);
            }
            let step = step_granules * granule;
            let mut locked = Window::EMPTY;
            let mut steps = 0u64;
            while let Some(range) = next_lock_step(locked, target, step, SEG) {
                prop_assert!(!range.is_empty());
                prop_assert!(range.bytes() <= step);
                prop_assert_eq!(range.start % granule, 0);
                prop_assert_eq!(range.end % granule, 0);
                prop_assert_eq!(range.start / SEG, (range.end - 1) / SEG, "one segment");
                prop_assert!(range.intersect(&locked).is_empty());
                prop_assert_eq!(range.intersect(&target), range);
                // Newest first: each range ends where the locked part starts.
                if !locked.is_empty() {
                    prop_assert_eq!(range.end, locked.start);
                } else {
                    prop_assert_eq!(range.end, target.end);
                }
                locked = widen(locked, range);
                steps += 1;
                prop_assert!(steps <= target.bytes() / step + target.bytes() / SEG + 2);
            }
            prop_assert_eq!(locked, target);
        }

        #[test]
        fn a_moving_target_keeps_the_lock_contiguous(
            moves in proptest::collection::vec((0u64..3000, 0u64..3000, 1u64..64), 1..20),
        ) {
            let granule = 65536;
            let mut end = 0u64;
            let mut locked = Window::EMPTY;
            for (advance_pages, budget_pages, step_granules) in moves {
                end += advance_pages * WAL_PAGE;
                let mapped = Window::newest(end, 2000);
                let target = lock_target(mapped, budget_pages * WAL_PAGE, granule);
                // What the worker does: unlock what left the target, then lock a few steps.
                locked = locked.intersect(&target);
                for _ in 0..3 {
                    match next_lock_step(locked, target, step_granules * granule, SEG) {
                        Some(range) => locked = widen(locked, range),
                        None => break,
                    }
                }
                prop_assert_eq!(locked.intersect(&target), locked);
                prop_assert_eq!(locked.start % granule, 0);
                prop_assert_eq!(locked.end % granule, 0);
            }
        }

        #[test]
        fn every_page_is_counted_once(steps in proptest::collection::vec((0u64..5000, 0u64..6000, 0u64..200), 1..50)) {
            let mut slot = SlotCounter::starting_at(0);
            let mut furthest = 0u64;
            for (position_pages, held_start, held_len) in steps {
                let position = position_pages * WAL_PAGE + position_pages % 7;
                let held = Window { start: held_start * WAL_PAGE, end: (held_start + held_len) * WAL_PAGE };
                let before = slot;
                let step = slot.advance(position, held);
                furthest = furthest.max(page_ceil(position) / WAL_PAGE);
                prop_assert_eq!(slot.consumed_pages, furthest);
                prop_assert_eq!(step.hits + step.misses, slot.consumed_pages - before.consumed_pages);
                prop_assert!(step.hits <= held.pages().max(slot.consumed_pages - before.consumed_pages));
            }
            prop_assert_eq!(slot.blocks_read(), furthest);
        }

        #[test]
        fn pieces_cover_the_range_exactly(start in 0u64..1 << 40, pages in 0u64..10_000) {
            let start = start * WAL_PAGE;
            let range = Window { start, end: start + pages * WAL_PAGE };
            let pieces = segment_pieces(range, SEG);
            let total: u64 = pieces.iter().map(|p| p.offsets.end - p.offsets.start).sum();
            prop_assert_eq!(total, range.bytes());
            for pair in pieces.windows(2) {
                prop_assert_eq!(pair[0].segno + 1, pair[1].segno);
                prop_assert_eq!(pair[0].offsets.end, SEG);
                prop_assert_eq!(pair[1].offsets.start, 0);
            }
            let segs = segments_of(range, SEG);
            prop_assert_eq!(segs.end - segs.start, pieces.len() as u64);
        }
    }
}
