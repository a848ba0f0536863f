//! The arithmetic of pg_ccm's logical WAL cache, free of PostgreSQL so that `cargo test`
//! covers it in milliseconds.
//!
//! The cache holds the newest `size` WAL pages (XLOG_BLCKSZ, 8 kB) behind the flush
//! position, first-in first-out: a page enters when it is written and leaves when the
//! window has moved `size` pages past it. The background worker maps those pages from the
//! segment files and locks them in memory; this crate says *which* pages (`Window`,
//! `segment_pieces`), and how a replication slot's progress turns into hits and misses
//! (`SlotCounter`).

use std::ops::Range;

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

    proptest! {
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
