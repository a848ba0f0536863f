//! The agent's side of the change feed (extension 0.5.0, `ccm_buffer_changes()`): a mirror
//! of what the primary caches (its hot set and, with extension 0.6.0 and fill_room, its
//! colder blocks) and of what each standby caches, so that each cycle sends every standby
//! exactly what it lacks.
//!
//! Both ends are counted mirrors of the nodes' feeds: a block's count goes up with each
//! report that adds it and down with each that removes it. A node's feed can report a block
//! twice (read into a second buffer before its sweep reached the first one) and remove it
//! once later; counting keeps the mirror equal to what the node's feed holds, where a plain
//! set would drop a block the node still caches and never hear of it again.
//!
//! For each standby, every block the primary caches is in exactly one place: its feed
//! reported it cached (`cached`, which holds every block the standby reported, so a block
//! it cached before the primary wanted it is never sent), `missing_hot` or `missing_colder`
//! (to be sent: the hot ones every cycle, the colder ones only into unused buffers), or
//! `inflight` (sent; its feed will report it once its sweep passes the buffer). A block sent
//! and not reported after two full sweeps of the standby's feed was not loaded, or was loaded
//! and evicted again: it is missing once more. So a lost or skipped block is sent again,
//! and a block is never hidden for good: the nodes' buffer headers stay the ground truth.
//!
//! Answers are applied in the order the node produced them. A node's answer with `reset`
//! means the node forgot what it told us, so everything we know from it goes (the primary:
//! what it caches; a standby: what it holds). No work here is proportional to the cache in a
//! steady cycle: the sets change by what an answer lists, and only what was sent is aged.
//!
//! Memory: every set is a compressed bitmap per relation fork (roaring), not a hash set of
//! blocks, and a standby is sent at most [`TAKE_MAX`] blocks per take, chosen set by set
//! (hottest usage count first) without listing everything it lacks. For a primary and two
//! standbys, all of their shared_buffers hot, the unit test below measures the mirror at
//! 8 GB each: 2.2 MB with a data set cached whole, 8.0 MB with a scattered sixteenth of a
//! larger table cached, at most 16 MB while a cold standby's blocks are taken (138 MB warm
//! with the hash sets before). Run once at 64 GB each (2^23 buffers): 5.7 MB, 64 MB, 72 MB.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use ccm_codec::{encode_block_list, BlockAddress, BlockList, HotBlock, RelFork};
use roaring::{RoaringBitmap, RoaringTreemap};

/// A node's answer to `ccm_buffer_changes()`.
#[derive(Debug, Clone)]
pub struct FeedAnswer {
    pub seq: i64,
    pub reset: bool,
    pub reset_reason: Option<String>,
    pub tracked: i64,
    pub sweeps: i64,
    pub visited: i64,
    pub added: BlockList,
    pub removed: BlockList,
    /// The colder set's changes (a primary's feed asked with `colder`, extension 0.6.0).
    pub colder_added: Option<BlockList>,
    pub colder_removed: Option<BlockList>,
}

/// A random nonzero subscriber id for this agent process.
pub fn new_subscriber() -> i64 {
    loop {
        let id = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish() as i64;
        if id != 0 {
            return id;
        }
    }
}

/// Headers a call sweeps on a node of `buffers` buffers: all of them up to 2^18 (2 GB),
/// else a quarter (at least 2^18), so that a full sweep takes at most four cycles. A header
/// costs 3 to 8 ns (a cache miss on its descriptor and its shadow entry): a quarter of
/// 64 GB is about 15 ms a cycle, and a block that turns hot is seen within four cycles.
pub fn sweep_budget(buffers: i64) -> i64 {
    const SMALL: i64 = 1 << 18;
    const CYCLES: i64 = 4;
    if buffers <= SMALL {
        buffers.max(0)
    } else {
        ((buffers + CYCLES - 1) / CYCLES).max(SMALL)
    }
}

/// Full sweeps of a standby's feed after which a block sent to it and not reported is sent
/// again: the sweep under way may have passed its buffer before the load, the next one
/// cannot.
const INFLIGHT_SWEEPS: i64 = 2;

/// The most blocks one `take_missing` hands out: 2 GB of pages. A cold standby of 64 GB is
/// sent what it lacks over several takes (its share of a cycle ends with each), so that
/// no list of everything it lacks is ever built: about 6 MB of addresses at a time.
pub const TAKE_MAX: usize = 1 << 18;

/// The usage counts a buffer can have (0 to BM_MAX_USAGE_COUNT, 5).
const USAGE_LEVELS: usize = 6;

/// The mirror's few hash maps (relation forks, blocks counted twice) hash with foldhash,
/// seeded per map: several times faster than SipHash, and the keys come from our own nodes.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A set of blocks, each keyed by its relation fork's number in [`Rels`] (high 32 bits) and
/// its block number: a compressed bitmap per relation fork (roaring), 2 bytes a block where
/// a fork's cached blocks are sparse and down to 1 bit where they are dense. A hash set took
/// 16 to 32 bytes a block, which at 64 GB of shared_buffers made the agent's memory grow to
/// gigabytes for a primary and two standbys.
type Blocks = RoaringTreemap;

fn key(rel: u32, block: u32) -> u64 {
    u64::from(rel) << 32 | u64::from(block)
}

/// The relation forks the nodes reported blocks of, numbered in the order first added. One
/// entry per relation fork ever added (a new relfilenode after a rewrite is a new one; a
/// removal or a lookup numbers nothing), a few dozen bytes each, kept for the agent's life.
#[derive(Debug, Default)]
struct Rels {
    forks: Vec<RelFork>,
    ids: Map<RelFork, u32>,
}

impl Rels {
    /// The key of `addr`, numbering its relation fork if new.
    fn key(&mut self, addr: &BlockAddress) -> u64 {
        if let Some(key) = self.get(addr) {
            return key;
        }
        let fork = addr.rel_fork();
        let id = u32::try_from(self.forks.len()).expect("fewer than 2^32 relation forks");
        self.forks.push(fork);
        self.ids.insert(fork, id);
        key(id, addr.block)
    }

    /// The key of `addr` if its relation fork is numbered: a block of a fork never reported
    /// is in none of the sets, so a lookup need not number it.
    fn get(&self, addr: &BlockAddress) -> Option<u64> {
        let id = *self.ids.get(&addr.rel_fork())?;
        Some(key(id, addr.block))
    }

    /// The relation forks of `set` in address order (tablespace, database, relfilenode,
    /// fork), each with its number and its blocks.
    fn in_address_order<'a>(&self, set: &'a Blocks) -> Vec<(RelFork, u32, &'a RoaringBitmap)> {
        let mut forks: Vec<_> = set
            .bitmaps()
            .map(|(id, blocks)| (self.forks[id as usize], id, blocks))
            .collect();
        forks.sort_unstable_by_key(|&(fork, ..)| fork);
        forks
    }
}

/// A block set that counts: a block's count goes up with each report that adds it and down
/// with each that removes it, and it leaves the set with its last report. Counts above one
/// happen for a sweep's length at most (a block read into a second buffer before the sweep
/// reached the first), so they are kept apart, in a small map.
#[derive(Debug, Default)]
struct Counted {
    /// Every block counted at least once.
    once: Blocks,
    /// Blocks counted more than once, with their count less one.
    more: Map<u64, u32>,
}

impl Counted {
    /// Counts a report that adds `key`; true if it was not in the set.
    fn add(&mut self, key: u64) -> bool {
        if self.once.insert(key) {
            return true;
        }
        *self.more.entry(key).or_insert(0) += 1;
        false
    }

    /// Counts a report that removes `key`; true if that was its last. A removal of a block
    /// never added (the feed started after it) changes nothing: a node's removal always
    /// follows its addition in the node's order.
    fn remove(&mut self, key: u64) -> bool {
        if let Some(more) = self.more.get_mut(&key) {
            *more -= 1;
            if *more == 0 {
                self.more.remove(&key);
            }
            return false;
        }
        self.once.remove(key)
    }

    fn contains(&self, key: u64) -> bool {
        self.once.contains(key)
    }

    fn clear(&mut self) {
        self.once.clear();
        self.more.clear();
    }
}

/// Which of the primary's sets a block is in: the hot set is sent every cycle, the colder
/// blocks only into a standby's unused buffers (fill_room).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Hot,
    Colder,
}

/// What the primary caches: its hot and colder sets as its feed reports them, and the
/// usage count last reported for each block (one set per count: a block is in one).
#[derive(Debug, Default)]
struct Primary {
    hot: Counted,
    colder: Counted,
    usage: [Blocks; USAGE_LEVELS],
}

impl Primary {
    fn class(&self, key: u64) -> Option<Class> {
        if self.hot.contains(key) {
            Some(Class::Hot)
        } else if self.colder.contains(key) {
            Some(Class::Colder)
        } else {
            None
        }
    }

    fn set(&mut self, class: Class) -> &mut Counted {
        match class {
            Class::Hot => &mut self.hot,
            Class::Colder => &mut self.colder,
        }
    }

    fn set_usage(&mut self, key: u64, usage: u8) {
        let level = usize::from(usage).min(USAGE_LEVELS - 1);
        if self.usage[level].insert(key) {
            for (other, set) in self.usage.iter_mut().enumerate() {
                if other != level {
                    set.remove(key);
                }
            }
        }
    }

    fn usage_of(&self, key: u64) -> u8 {
        self.usage
            .iter()
            .position(|set| set.contains(key))
            .map_or(0, |level| level as u8)
    }

    fn forget(&mut self, key: u64) {
        for set in &mut self.usage {
            set.remove(key);
        }
    }

    fn clear(&mut self) {
        self.hot.clear();
        self.colder.clear();
        self.usage.iter_mut().for_each(Blocks::clear);
    }
}

/// What the agent knows of one standby.
#[derive(Debug, Default)]
pub struct View {
    /// Every block its feed reports cached, counted.
    cached: Counted,
    missing_hot: Blocks,
    missing_colder: Blocks,
    /// Sent and not reported yet: one set per full-sweep count of its feed when they were
    /// sent (two or three sets live at a time).
    inflight: Vec<(i64, Blocks)>,
    /// Its feed's full sweeps in its last answer.
    sweeps: i64,
    /// Its feed completed a full sweep since its last reset.
    pub complete: bool,
}

impl View {
    fn missing(&mut self, class: Class) -> &mut Blocks {
        match class {
            Class::Hot => &mut self.missing_hot,
            Class::Colder => &mut self.missing_colder,
        }
    }

    /// Forgets what the primary caches, as far as it concerns this standby: what it lacks
    /// and what it was sent. What it caches stays known.
    fn forget_primary(&mut self) {
        self.inflight.clear();
        self.missing_hot.clear();
        self.missing_colder.clear();
    }

    /// Forgets what it was sent and counts every block `primary` caches as missing, except
    /// those it caches.
    fn miss_all(&mut self, primary: &Primary) {
        self.forget_primary();
        self.missing_hot = &primary.hot.once - &self.cached.once;
        self.missing_colder = &(&primary.colder.once - &primary.hot.once) - &self.cached.once;
    }

    fn is_inflight(&self, key: u64) -> bool {
        self.inflight.iter().any(|(_, set)| set.contains(key))
    }

    /// Takes `key` off the blocks in flight; true if it was one.
    fn land(&mut self, key: u64) -> bool {
        let mut was = false;
        for (_, set) in &mut self.inflight {
            was |= set.remove(key);
        }
        if was {
            self.inflight.retain(|(_, set)| !set.is_empty());
        }
        was
    }

    fn inflight_len(&self) -> u64 {
        self.inflight.iter().map(|(_, set)| set.len()).sum()
    }

    /// `blocks` were sent at its feed's current sweep count.
    fn send(&mut self, blocks: Blocks) {
        match self.inflight.last_mut() {
            Some((at, set)) if *at == self.sweeps => *set |= blocks,
            _ => self.inflight.push((self.sweeps, blocks)),
        }
    }

    /// What was sent `INFLIGHT_SWEEPS` full sweeps ago or earlier and is not reported yet
    /// is missing again, if the primary still caches it.
    fn expire(&mut self, primary: &Primary) {
        let sweeps = self.sweeps;
        let (expired, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.inflight)
            .into_iter()
            .partition(|(at, _)| sweeps >= at + INFLIGHT_SWEEPS);
        self.inflight = kept;
        for (_, set) in expired {
            self.missing_hot |= &set & &primary.hot.once;
            self.missing_colder |= &(&set & &primary.colder.once) - &primary.hot.once;
        }
    }

    /// The primary's block `key` went from set `before` to set `after`.
    fn reclassify(&mut self, key: u64, before: Option<Class>, after: Option<Class>) {
        match (before, after) {
            (b, a) if b == a => {}
            (_, None) => {
                self.missing_hot.remove(key);
                self.missing_colder.remove(key);
                self.land(key);
            }
            (None, Some(class)) => {
                if !self.cached.contains(key) && !self.is_inflight(key) {
                    self.missing(class).insert(key);
                }
            }
            (Some(from), Some(to)) => {
                if self.missing(from).remove(key) {
                    self.missing(to).insert(key);
                }
            }
        }
    }
}

/// What the primary caches and every standby's view of it.
#[derive(Debug, Default)]
pub struct Mirror {
    rels: Rels,
    primary: Primary,
    /// The primary's feed completed a full sweep since its last reset.
    pub complete: bool,
    views: HashMap<String, View>,
}

impl Mirror {
    pub fn hot_len(&self) -> usize {
        self.primary.hot.once.len() as usize
    }

    fn view(&mut self, name: &str) -> &mut View {
        if !self.views.contains_key(name) {
            // A new standby lacks everything until its feed says otherwise.
            let mut view = View::default();
            view.miss_all(&self.primary);
            self.views.insert(name.to_string(), view);
        }
        self.views.get_mut(name).expect("inserted above")
    }

    /// Forgets standbys that are no longer in the topology.
    pub fn retain_standbys(&mut self, names: &[String]) {
        self.views.retain(|name, _| names.contains(name));
    }

    /// One report of the primary's: `addr` entered (`up`) or left set `class`.
    fn count_primary(&mut self, addr: &BlockAddress, usage: u8, class: Class, up: bool) {
        let key = if up {
            Some(self.rels.key(addr))
        } else {
            self.rels.get(addr)
        };
        // A removal of a block never added (the feed started after it) changes nothing.
        let Some(key) = key else {
            return;
        };
        let before = self.primary.class(key);
        if up {
            self.primary.set(class).add(key);
            self.primary.set_usage(key, usage);
        } else {
            self.primary.set(class).remove(key);
        }
        let after = self.primary.class(key);
        if after.is_none() && before.is_some() {
            self.primary.forget(key);
        }
        for view in self.views.values_mut() {
            view.reclassify(key, before, after);
        }
    }

    /// Applies the primary's answer.
    pub fn apply_primary(&mut self, answer: &FeedAnswer) {
        if answer.reset {
            self.primary.clear();
            for view in self.views.values_mut() {
                view.forget_primary();
            }
            self.complete = false;
        }
        // Additions first: a block moved from one buffer to another within the answer is
        // never dropped and added back (which would forget it was sent).
        for block in answer.added.iter() {
            self.count_primary(&block.addr, block.usage, Class::Hot, true);
        }
        for block in answer.colder_added.iter().flat_map(BlockList::iter) {
            self.count_primary(&block.addr, block.usage, Class::Colder, true);
        }
        for block in answer.removed.iter() {
            self.count_primary(&block.addr, 0, Class::Hot, false);
        }
        for block in answer.colder_removed.iter().flat_map(BlockList::iter) {
            self.count_primary(&block.addr, 0, Class::Colder, false);
        }
        self.complete |= answer.sweeps > 0;
    }

    /// Applies standby `name`'s answer.
    pub fn apply_standby(&mut self, name: &str, answer: &FeedAnswer) {
        self.view(name);
        let Mirror {
            rels,
            primary,
            views,
            ..
        } = self;
        let view = views.get_mut(name).expect("made by view()");
        if answer.reset {
            view.cached.clear();
            view.miss_all(primary);
            view.complete = false;
        }
        for block in answer.added.iter() {
            let key = rels.key(&block.addr);
            if view.cached.add(key) {
                view.missing_hot.remove(key);
                view.missing_colder.remove(key);
                view.land(key);
            }
        }
        for block in answer.removed.iter() {
            let Some(key) = rels.get(&block.addr) else {
                continue;
            };
            if view.cached.remove(key) {
                if let Some(class) = primary.class(key) {
                    view.missing(class).insert(key);
                }
            }
        }
        // What was sent two full sweeps ago and is not reported goes out again.
        view.sweeps = answer.sweeps;
        view.expire(primary);
        view.complete |= answer.sweeps > 0;
    }

    /// Up to `limit` of standby `name`'s missing blocks of `class` (at most [`TAKE_MAX`]) as
    /// one list; they become inflight. When it lacks more than `limit`, the hottest first;
    /// otherwise in address order, so that a standby with room for all it lacks reads its
    /// files front to back, take after take. Within a usage count, address order. None when
    /// nothing is missing. Nothing the size of what it lacks is materialised.
    pub fn take_missing(&mut self, name: &str, class: Class, limit: usize) -> Option<BlockList> {
        self.view(name);
        let Mirror {
            rels,
            primary,
            views,
            ..
        } = self;
        let view = views.get_mut(name).expect("made by view()");
        let missing = view.missing(class);
        if missing.is_empty() || limit == 0 {
            return None;
        }
        let hottest_first = missing.len() > limit as u64;
        let take = limit.min(TAKE_MAX);
        let mut blocks: Vec<HotBlock> = Vec::with_capacity(take.min(missing.len() as usize));
        let mut taken = Blocks::new();
        let mut pick = |set: &Blocks, usage: Option<u8>, blocks: &mut Vec<HotBlock>| {
            for (fork, id, bitmap) in rels.in_address_order(set) {
                for block in bitmap {
                    if blocks.len() == take {
                        return;
                    }
                    let key = key(id, block);
                    taken.insert(key);
                    blocks.push(HotBlock {
                        addr: fork.block(block),
                        usage: usage.unwrap_or_else(|| primary.usage_of(key)),
                    });
                }
            }
        };
        if hottest_first {
            for level in (0..USAGE_LEVELS).rev() {
                if blocks.len() == take {
                    break;
                }
                pick(
                    &(&*missing & &primary.usage[level]),
                    Some(level as u8),
                    &mut blocks,
                );
            }
        } else {
            pick(missing, None, &mut blocks);
        }
        *missing -= &taken;
        view.send(taken);
        let bytes = encode_block_list(&mut blocks, primary.hot.once.len(), 0)
            .expect("addresses from valid lists");
        Some(BlockList::decode(&bytes).expect("a list we just encoded"))
    }

    /// Blocks of `batches` (lists take_missing made, then split) that were not sent to
    /// standby `name` after all (its share of the cycle ended first): missing again.
    pub fn unsend(&mut self, name: &str, batches: &[Vec<u8>]) {
        let Mirror {
            rels,
            primary,
            views,
            ..
        } = self;
        let Some(view) = views.get_mut(name) else {
            return;
        };
        for list in batches
            .iter()
            .filter_map(|bytes| BlockList::decode(bytes).ok())
        {
            for block in list.iter() {
                let Some(key) = rels.get(&block.addr) else {
                    continue;
                };
                if view.land(key) {
                    if let Some(class) = primary.class(key) {
                        view.missing(class).insert(key);
                    }
                }
            }
        }
    }

    /// Hot blocks standby `name` does not hold yet (missing, or sent and not reported).
    pub fn lacking(&self, name: &str) -> usize {
        self.views.get(name).map_or(self.hot_len(), |v| {
            let inflight_hot: u64 = v
                .inflight
                .iter()
                .map(|(_, set)| set.intersection_len(&self.primary.hot.once))
                .sum();
            (v.missing_hot.len() + inflight_hot) as usize
        })
    }

    /// Whether standby `name`'s feed swept all its buffers since its last reset.
    pub fn standby_complete(&self, name: &str) -> bool {
        self.views.get(name).is_some_and(|v| v.complete)
    }

    /// Blocks sent to standby `name` that its feed has not reported yet: they may already
    /// take buffers its feed still counts as unused.
    pub fn inflight(&self, name: &str) -> usize {
        self.views
            .get(name)
            .map_or(0, |v| v.inflight_len() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(block: u32) -> BlockAddress {
        BlockAddress {
            spc: 1663,
            db: 5,
            rel: 16384,
            fork: 0,
            block,
        }
    }

    fn packed(blocks: &[(u32, u8)]) -> Vec<u8> {
        let mut hot: Vec<HotBlock> = blocks
            .iter()
            .map(|&(b, usage)| HotBlock {
                addr: addr(b),
                usage,
            })
            .collect();
        encode_block_list(&mut hot, 0, 0).unwrap()
    }

    fn list(blocks: &[(u32, u8)]) -> BlockList {
        BlockList::decode(&packed(blocks)).unwrap()
    }

    fn answer(reset: bool, added: &[(u32, u8)], removed: &[u32]) -> FeedAnswer {
        let removed: Vec<(u32, u8)> = removed.iter().map(|&b| (b, 0)).collect();
        FeedAnswer {
            seq: 1,
            reset,
            reset_reason: None,
            tracked: 0,
            sweeps: 1,
            visited: 100,
            added: list(added),
            removed: list(&removed),
            colder_added: None,
            colder_removed: None,
        }
    }

    fn colder(mut a: FeedAnswer, added: &[(u32, u8)], removed: &[u32]) -> FeedAnswer {
        let removed: Vec<(u32, u8)> = removed.iter().map(|&b| (b, 0)).collect();
        a.colder_added = Some(list(added));
        a.colder_removed = Some(list(&removed));
        a
    }

    fn swept(mut a: FeedAnswer, sweeps: i64) -> FeedAnswer {
        a.sweeps = sweeps;
        a
    }

    fn sent(m: &mut Mirror, name: &str, class: Class) -> Vec<u32> {
        m.take_missing(name, class, usize::MAX)
            .map_or(vec![], |l| l.iter().map(|b| b.addr.block).collect())
    }

    #[test]
    fn hot_blocks_are_sent_hottest_first_and_confirmed_by_the_feed() {
        let mut m = Mirror::default();
        m.apply_standby("s", &answer(true, &[], &[]));
        m.apply_primary(&answer(true, &[(1, 4), (2, 5), (3, 4)], &[]));
        let first = m.take_missing("s", Class::Hot, 1).unwrap();
        assert_eq!(
            first.iter().map(|b| b.addr.block).collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![1, 3]);
        assert_eq!((m.lacking("s"), m.inflight("s")), (3, 3));
        // The standby's sweep reports 1 and 2; 3 stays inflight until two full sweeps passed.
        m.apply_standby("s", &swept(answer(false, &[(1, 4), (2, 5)], &[]), 2));
        assert_eq!(m.lacking("s"), 1);
        assert_eq!(sent(&mut m, "s", Class::Hot), Vec::<u32>::new());
        m.apply_standby("s", &swept(answer(false, &[], &[]), 3));
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![3]);
    }

    #[test]
    fn blocks_taken_but_not_sent_go_out_next_cycle() {
        let mut m = Mirror::default();
        m.apply_standby("s", &answer(true, &[], &[]));
        m.apply_primary(&answer(true, &[(1, 5), (2, 5), (3, 5)], &[]));
        let list = m.take_missing("s", Class::Hot, usize::MAX).unwrap();
        // One batch went out; replay lag ended the cycle before the other.
        let batches = list.split_hottest_first(2);
        m.unsend("s", &batches[1..]);
        assert_eq!(m.inflight("s"), 2);
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![3]);
    }

    #[test]
    fn a_block_the_standby_cached_before_it_became_hot_is_not_sent() {
        let mut m = Mirror::default();
        m.apply_standby("s", &answer(true, &[(7, 1)], &[]));
        m.apply_primary(&answer(true, &[(7, 5), (8, 5)], &[]));
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![8]);
    }

    #[test]
    fn an_eviction_on_the_standby_sends_the_block_again() {
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5)], &[]));
        m.apply_standby("s", &answer(true, &[(1, 5)], &[]));
        assert_eq!(m.lacking("s"), 0);
        m.apply_standby("s", &answer(false, &[(9, 1)], &[1]));
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![1]);
    }

    #[test]
    fn a_block_reported_from_two_buffers_stays_until_both_are_gone() {
        // Block 1 left buffer A (not swept yet) for buffer B (swept): added twice, then the
        // sweep reaches A and removes it once. The primary and the standby still hold it.
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5)], &[]));
        m.apply_standby("s", &answer(true, &[(1, 5)], &[]));
        m.apply_primary(&answer(false, &[(1, 5)], &[]));
        m.apply_standby("s", &answer(false, &[(1, 5)], &[]));
        m.apply_primary(&answer(false, &[], &[1]));
        m.apply_standby("s", &answer(false, &[], &[1]));
        assert_eq!((m.hot_len(), m.lacking("s")), (1, 0));
        // The last copy goes: on the standby, it is missing; on the primary, no longer hot.
        m.apply_standby("s", &answer(false, &[], &[1]));
        assert_eq!(m.lacking("s"), 1);
        m.apply_primary(&answer(false, &[], &[1]));
        assert_eq!((m.hot_len(), m.lacking("s")), (0, 0));
    }

    #[test]
    fn lookups_do_not_number_relation_forks() {
        // Removals and unsent batches of a fork never reported added leave no entry behind.
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[], &[1]));
        m.apply_standby("s", &answer(true, &[], &[2]));
        m.unsend("s", &[packed(&[(3, 5)])]);
        assert!(m.rels.forks.is_empty());
        m.apply_primary(&answer(false, &[(1, 5)], &[]));
        assert_eq!((m.rels.forks.len(), m.lacking("s")), (1, 1));
    }

    #[test]
    fn a_block_that_cools_on_the_primary_is_no_longer_counted() {
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5), (2, 5)], &[]));
        m.apply_standby("s", &answer(true, &[(1, 5)], &[]));
        m.apply_primary(&answer(false, &[], &[2]));
        assert_eq!((m.hot_len(), m.lacking("s")), (1, 0));
    }

    #[test]
    fn colder_blocks_are_kept_apart_and_move_with_their_usage() {
        let mut m = Mirror::default();
        m.apply_standby("s", &answer(true, &[(4, 1)], &[]));
        m.apply_primary(&colder(
            answer(true, &[(1, 5)], &[]),
            &[(2, 1), (3, 3), (4, 2)],
            &[],
        ));
        assert_eq!((m.hot_len(), m.lacking("s")), (1, 1));
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![1]);
        // Hottest colder block first; 4 is cached on the standby already.
        let first = m.take_missing("s", Class::Colder, 1).unwrap();
        assert_eq!(
            first.iter().map(|b| b.addr.block).collect::<Vec<_>>(),
            vec![3]
        );
        // 2 warms up: it is sent with the hot blocks now; 1 cools down.
        m.apply_primary(&colder(answer(false, &[(2, 5)], &[1]), &[(1, 3)], &[2]));
        assert_eq!(m.hot_len(), 1);
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![2]);
        assert_eq!(sent(&mut m, "s", Class::Colder), Vec::<u32>::new());
        // Evicted on the primary: gone from every set.
        m.apply_primary(&colder(answer(false, &[], &[]), &[], &[1, 3]));
        m.apply_standby("s", &swept(answer(false, &[], &[]), 9));
        assert_eq!(sent(&mut m, "s", Class::Colder), Vec::<u32>::new());
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![2]);
    }

    #[test]
    fn resets_forget_what_the_node_told() {
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5), (2, 5)], &[]));
        m.apply_standby("s", &answer(true, &[(1, 5), (2, 5)], &[]));
        assert_eq!(m.lacking("s"), 0);
        // The standby restarted: it may hold nothing.
        m.apply_standby("s", &answer(true, &[(2, 5)], &[]));
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![1]);
        // The primary's feed started over: what it caches is rebuilt from its answers; what
        // the standby holds is still known.
        m.apply_primary(&answer(true, &[(2, 5), (3, 5)], &[]));
        assert_eq!((m.hot_len(), m.lacking("s")), (2, 1));
        assert_eq!(sent(&mut m, "s", Class::Hot), vec![3]);
    }

    #[test]
    fn a_new_standby_lacks_the_whole_hot_set() {
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5), (2, 4)], &[]));
        assert_eq!(m.lacking("new"), 2);
        assert_eq!(sent(&mut m, "new", Class::Hot), vec![1, 2]);
        m.retain_standbys(&[]);
        assert_eq!(m.lacking("new"), 2);
    }

    /// Blocks of one relation fork (relfilenode `rel`).
    fn of(rel: u32, blocks: impl IntoIterator<Item = u32>, usage: u8) -> Vec<HotBlock> {
        blocks
            .into_iter()
            .map(|block| HotBlock {
                addr: BlockAddress {
                    spc: 1663,
                    db: 5,
                    rel,
                    fork: 0,
                    block,
                },
                usage,
            })
            .collect()
    }

    /// 8 GB of shared_buffers (2^20 buffers), all hot: a pgbench-like data set cached whole
    /// (a table, its index, 200 small relations), or a table 16 times larger than the cache
    /// of which every 16th-or-so block is cached (a scattered, pseudo-random choice).
    fn eight_gb(scattered: bool) -> Vec<HotBlock> {
        let mut blocks = Vec::new();
        if scattered {
            let mut x: u64 = 1;
            let mut chosen = std::collections::BTreeSet::new();
            while chosen.len() < 1 << 20 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                chosen.insert(((x >> 33) % (1 << 24)) as u32);
            }
            blocks.extend(of(16384, chosen, 5));
        } else {
            blocks.extend(of(16384, 0..700_000, 5));
            blocks.extend(of(16385, 0..148_576, 4));
            for rel in 0..200 {
                blocks.extend(of(20000 + rel, 0..1000, 5));
            }
        }
        assert_eq!(blocks.len(), 1 << 20);
        blocks
    }

    /// Feeds `blocks` to the mirror as `node`'s answers of at most 2^16 blocks each (None:
    /// the primary), the first with a reset.
    fn feed(m: &mut Mirror, node: Option<&str>, blocks: &[HotBlock]) {
        for (i, chunk) in blocks.chunks(1 << 16).enumerate() {
            let mut chunk = chunk.to_vec();
            let mut a = answer(i == 0, &[], &[]);
            a.added = BlockList::decode(&encode_block_list(&mut chunk, 0, 0).unwrap()).unwrap();
            match node {
                None => m.apply_primary(&a),
                Some(name) => m.apply_standby(name, &a),
            }
        }
    }

    #[test]
    fn the_mirror_of_a_primary_and_two_standbys_at_64_gb_fits_in_256_mb() {
        // Measured at 8 GB (2^20 buffers per node) and extrapolated per buffer (x 8), as the
        // agent's issue asks: the mirror's bytes, counted by the test allocator (heap.rs),
        // for a primary whose whole cache is hot and two standbys, warm and then cold. The
        // rest of the agent (runtime, sessions, TLS) does not grow with shared_buffers.
        const BUDGET_64GB: isize = 256 << 20;
        const PROCESS: isize = 32 << 20; // the agent's RSS with an empty mirror is below this
        let budget_8gb = (BUDGET_64GB - PROCESS) / 8;
        for scattered in [false, true] {
            let blocks = eight_gb(scattered);
            let before = crate::heap::live();
            let mut m = Mirror::default();
            feed(&mut m, None, &blocks);
            feed(&mut m, Some("a"), &blocks);
            feed(&mut m, Some("b"), &blocks);
            assert_eq!(
                (m.hot_len(), m.lacking("a"), m.lacking("b")),
                (1 << 20, 0, 0)
            );
            let warm = crate::heap::live() - before;
            // Both standbys restarted cold: everything is missing; then one cycle takes as
            // much as the standby has room for.
            m.apply_standby("a", &answer(true, &[], &[]));
            m.apply_standby("b", &answer(true, &[], &[]));
            crate::heap::reset_peak();
            let taken = m
                .take_missing("a", Class::Hot, 1 << 20)
                .map_or(0, |l| l.len());
            let cold_peak = crate::heap::peak() - before;
            let cold = crate::heap::live() - before;
            eprintln!(
                "8 GB {}: warm {:.1} MB ({:.1} B per buffer and node), cold {:.1} MB, \
                 peak while taking {} blocks {:.1} MB",
                if scattered { "scattered" } else { "dense" },
                warm as f64 / 1048576.0,
                warm as f64 / 3.0 / f64::from(1 << 20),
                cold as f64 / 1048576.0,
                taken,
                cold_peak as f64 / 1048576.0
            );
            assert!(warm <= budget_8gb, "warm: {warm} bytes > {budget_8gb}");
            assert!(
                cold_peak <= budget_8gb,
                "cold: {cold_peak} bytes > {budget_8gb}"
            );
            assert!(taken > 0);
            drop(m);
        }
    }

    /// The mirror's rules written plainly, with hash maps and sets of (relation, block), as
    /// the mirror kept them before its sets became bitmaps: the reference the randomized
    /// test below holds the mirror to.
    #[derive(Default)]
    struct Model {
        /// Block -> (usage, hot reports, colder reports).
        primary: HashMap<(u32, u32), (u8, u32, u32)>,
        views: HashMap<String, ModelView>,
    }

    #[derive(Default, Clone)]
    struct ModelView {
        cached: HashMap<(u32, u32), u32>,
        missing: [std::collections::BTreeSet<(u32, u32)>; 2],
        inflight: HashMap<(u32, u32), i64>,
        sweeps: i64,
    }

    fn slot(class: Class) -> usize {
        match class {
            Class::Hot => 0,
            Class::Colder => 1,
        }
    }

    impl Model {
        fn class(&self, b: (u32, u32)) -> Option<Class> {
            match self.primary.get(&b) {
                Some(&(_, hot, _)) if hot > 0 => Some(Class::Hot),
                Some(&(_, _, colder)) if colder > 0 => Some(Class::Colder),
                _ => None,
            }
        }

        fn view(&mut self, name: &str) -> &mut ModelView {
            if !self.views.contains_key(name) {
                let mut v = ModelView::default();
                for &b in self.primary.keys() {
                    if let Some(c) = self.class(b) {
                        v.missing[slot(c)].insert(b);
                    }
                }
                self.views.insert(name.into(), v);
            }
            self.views.get_mut(name).unwrap()
        }

        fn primary(
            &mut self,
            reset: bool,
            added: &[((u32, u32), u8, Class)],
            removed: &[((u32, u32), Class)],
        ) {
            if reset {
                self.primary.clear();
                for v in self.views.values_mut() {
                    v.inflight.clear();
                    v.missing = Default::default();
                }
            }
            // In the order apply_primary takes an answer: the hot set's additions, the colder
            // set's, then the removals of each.
            let adds = |c: Class| {
                added
                    .iter()
                    .filter(move |x| x.2 == c)
                    .map(|&(b, u, c)| (b, u, c, true))
            };
            let drops = |c: Class| {
                removed
                    .iter()
                    .filter(move |x| x.1 == c)
                    .map(|&(b, c)| (b, 0, c, false))
            };
            let changes = adds(Class::Hot)
                .chain(adds(Class::Colder))
                .chain(drops(Class::Hot))
                .chain(drops(Class::Colder));
            for (b, usage, class, up) in changes {
                if !up && !self.primary.contains_key(&b) {
                    continue;
                }
                let before = self.class(b);
                let e = self.primary.entry(b).or_default();
                let count = if class == Class::Hot {
                    &mut e.1
                } else {
                    &mut e.2
                };
                if up {
                    *count += 1;
                    e.0 = usage;
                } else {
                    *count = count.saturating_sub(1);
                }
                let after = self.class(b);
                if after.is_none() {
                    self.primary.remove(&b);
                }
                for v in self.views.values_mut() {
                    match (before, after) {
                        (x, y) if x == y => {}
                        (_, None) => {
                            v.missing[0].remove(&b);
                            v.missing[1].remove(&b);
                            v.inflight.remove(&b);
                        }
                        (None, Some(c)) => {
                            if !v.cached.contains_key(&b) && !v.inflight.contains_key(&b) {
                                v.missing[slot(c)].insert(b);
                            }
                        }
                        (Some(x), Some(y)) => {
                            if v.missing[slot(x)].remove(&b) {
                                v.missing[slot(y)].insert(b);
                            }
                        }
                    }
                }
            }
        }

        fn standby(
            &mut self,
            name: &str,
            reset: bool,
            added: &[(u32, u32)],
            removed: &[(u32, u32)],
            sweeps: i64,
        ) {
            self.view(name);
            let classes: HashMap<(u32, u32), Class> = self
                .primary
                .keys()
                .filter_map(|&b| Some((b, self.class(b)?)))
                .collect();
            let v = self.views.get_mut(name).unwrap();
            if reset {
                v.cached.clear();
                v.inflight.clear();
                v.missing = Default::default();
                for (&b, &c) in &classes {
                    v.missing[slot(c)].insert(b);
                }
            }
            for &b in added {
                let n = v.cached.entry(b).or_insert(0);
                *n += 1;
                if *n == 1 {
                    v.missing[0].remove(&b);
                    v.missing[1].remove(&b);
                    v.inflight.remove(&b);
                }
            }
            for &b in removed {
                if let Some(n) = v.cached.get_mut(&b) {
                    *n -= 1;
                    if *n == 0 {
                        v.cached.remove(&b);
                        if let Some(&c) = classes.get(&b) {
                            v.missing[slot(c)].insert(b);
                        }
                    }
                }
            }
            v.sweeps = sweeps;
            let expired: Vec<_> = v
                .inflight
                .iter()
                .filter(|(_, &at)| sweeps >= at + INFLIGHT_SWEEPS)
                .map(|(&b, _)| b)
                .collect();
            for b in expired {
                v.inflight.remove(&b);
                if let Some(&c) = classes.get(&b) {
                    v.missing[slot(c)].insert(b);
                }
            }
        }

        /// What take_missing should hand out: all it lacks when that fits, else the hottest
        /// `limit`, ties in address order.
        fn take(&mut self, name: &str, class: Class, limit: usize) -> Vec<(u32, u32)> {
            self.view(name);
            let usage: HashMap<(u32, u32), u8> =
                self.primary.iter().map(|(&b, e)| (b, e.0)).collect();
            let v = self.views.get_mut(name).unwrap();
            let mut all: Vec<(u32, u32)> = v.missing[slot(class)].iter().copied().collect();
            if all.len() > limit {
                all.sort_by_key(|b| (std::cmp::Reverse(usage[b]), *b));
                all.truncate(limit);
            }
            for b in &all {
                v.missing[slot(class)].remove(b);
                v.inflight.insert(*b, v.sweeps);
            }
            all.sort();
            all
        }

        fn unsend(&mut self, name: &str, blocks: &[(u32, u32)]) {
            let classes: HashMap<(u32, u32), Class> = self
                .primary
                .keys()
                .filter_map(|&b| Some((b, self.class(b)?)))
                .collect();
            if let Some(v) = self.views.get_mut(name) {
                for b in blocks {
                    if v.inflight.remove(b).is_some() {
                        if let Some(&c) = classes.get(b) {
                            v.missing[slot(c)].insert(*b);
                        }
                    }
                }
            }
        }

        fn lacking(&self, name: &str) -> usize {
            let hot = self
                .primary
                .keys()
                .filter(|&&b| self.class(b) == Some(Class::Hot))
                .count();
            self.views.get(name).map_or(hot, |v| {
                v.missing[0].len()
                    + v.inflight
                        .keys()
                        .filter(|&&b| self.class(b) == Some(Class::Hot))
                        .count()
            })
        }
    }

    #[test]
    fn the_mirror_follows_its_rules_written_plainly_over_random_answers() {
        // Random answers of a primary and two standbys over two relations of 40 blocks, and
        // random takes and unsent batches, each applied to the mirror and to the model; every
        // take and every count must agree.
        let addr = |(rel, block): (u32, u32)| BlockAddress {
            spc: 1663,
            db: 5,
            rel,
            fork: 0,
            block,
        };
        let list = |blocks: Vec<HotBlock>| {
            let mut blocks = blocks;
            BlockList::decode(&encode_block_list(&mut blocks, 0, 0).unwrap()).unwrap()
        };
        for seed in 0..100 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut mirror = Mirror::default();
            let mut model = Model::default();
            let mut sweeps = [0i64; 2];
            let mut last_taken: Vec<(String, Vec<(u32, u32)>)> = Vec::new();
            for step in 0..300 {
                let block = |rng: &mut fastrand::Rng| (16384 + rng.u32(0..2), rng.u32(0..40));
                let names = ["a", "b"];
                match rng.u32(0..10) {
                    0..=3 => {
                        let reset = rng.u32(0..30) == 0;
                        // Each block once per answer, as a node's feed lists it.
                        let mut seen = std::collections::HashSet::new();
                        let added: Vec<_> = (0..rng.usize(0..8))
                            .map(|_| {
                                (
                                    block(&mut rng),
                                    rng.u8(0..6),
                                    if rng.bool() {
                                        Class::Hot
                                    } else {
                                        Class::Colder
                                    },
                                )
                            })
                            .filter(|&(b, _, c)| seen.insert((b, slot(c))))
                            .collect();
                        let mut gone = std::collections::HashSet::new();
                        let removed: Vec<_> = (0..rng.usize(0..6))
                            .map(|_| {
                                (
                                    block(&mut rng),
                                    if rng.bool() {
                                        Class::Hot
                                    } else {
                                        Class::Colder
                                    },
                                )
                            })
                            .filter(|&(b, c)| gone.insert((b, slot(c))))
                            .collect();
                        let mut a = answer(reset, &[], &[]);
                        let pick = |c: Class| -> Vec<HotBlock> {
                            added
                                .iter()
                                .filter(|x| x.2 == c)
                                .map(|&(b, u, _)| HotBlock {
                                    addr: addr(b),
                                    usage: u,
                                })
                                .collect()
                        };
                        let drop = |c: Class| -> Vec<HotBlock> {
                            removed
                                .iter()
                                .filter(|x| x.1 == c)
                                .map(|&(b, _)| HotBlock {
                                    addr: addr(b),
                                    usage: 0,
                                })
                                .collect()
                        };
                        a.added = list(pick(Class::Hot));
                        a.removed = list(drop(Class::Hot));
                        a.colder_added = Some(list(pick(Class::Colder)));
                        a.colder_removed = Some(list(drop(Class::Colder)));
                        mirror.apply_primary(&a);
                        model.primary(reset, &added, &removed);
                    }
                    4..=6 => {
                        let i = rng.usize(0..2);
                        let reset = rng.u32(0..30) == 0;
                        if reset {
                            sweeps[i] = 0;
                        }
                        sweeps[i] += i64::from(rng.u32(0..3) == 0);
                        let mut seen = std::collections::HashSet::new();
                        let added: Vec<_> = (0..rng.usize(0..6))
                            .map(|_| block(&mut rng))
                            .filter(|b| seen.insert(*b))
                            .collect();
                        let mut gone = std::collections::HashSet::new();
                        let removed: Vec<_> = (0..rng.usize(0..6))
                            .map(|_| block(&mut rng))
                            .filter(|b| gone.insert(*b))
                            .collect();
                        let blocks = |of: &[(u32, u32)], usage: u8| {
                            list(
                                of.iter()
                                    .map(|&b| HotBlock {
                                        addr: addr(b),
                                        usage,
                                    })
                                    .collect(),
                            )
                        };
                        let mut a = swept(answer(reset, &[], &[]), sweeps[i]);
                        a.added = blocks(&added, 1);
                        a.removed = blocks(&removed, 0);
                        mirror.apply_standby(names[i], &a);
                        model.standby(names[i], reset, &added, &removed, sweeps[i]);
                    }
                    7..=8 => {
                        let name = names[rng.usize(0..2)];
                        let class = if rng.bool() {
                            Class::Hot
                        } else {
                            Class::Colder
                        };
                        let limit = rng.usize(1..12);
                        let got: Vec<(u32, u32)> =
                            mirror.take_missing(name, class, limit).map_or(vec![], |l| {
                                l.iter().map(|b| (b.addr.rel, b.addr.block)).collect()
                            });
                        let want = model.take(name, class, limit);
                        assert_eq!(
                            got, want,
                            "seed {seed} step {step}: take {name} {class:?} {limit}"
                        );
                        last_taken.push((name.to_string(), got));
                    }
                    _ => {
                        if let Some((name, blocks)) = last_taken.pop() {
                            let back: Vec<_> =
                                blocks.iter().copied().filter(|_| rng.bool()).collect();
                            if !back.is_empty() {
                                let hot: Vec<HotBlock> = back
                                    .iter()
                                    .map(|&b| HotBlock {
                                        addr: addr(b),
                                        usage: 5,
                                    })
                                    .collect();
                                mirror.unsend(
                                    &name,
                                    &[encode_block_list(&mut hot.clone(), 0, 0).unwrap()],
                                );
                                model.unsend(&name, &back);
                            }
                        }
                    }
                }
                let hot = model
                    .primary
                    .keys()
                    .filter(|&&b| model.class(b) == Some(Class::Hot))
                    .count();
                assert_eq!(mirror.hot_len(), hot, "seed {seed} step {step}: hot set");
                for name in names {
                    assert_eq!(
                        mirror.lacking(name),
                        model.lacking(name),
                        "seed {seed} step {step}: lacking {name}"
                    );
                    let inflight = model.views.get(name).map_or(0, |v| v.inflight.len());
                    assert_eq!(
                        mirror.inflight(name),
                        inflight,
                        "seed {seed} step {step}: inflight {name}"
                    );
                }
            }
        }
    }

    #[test]
    fn sweep_budget_covers_small_pools_whole_and_large_ones_in_four() {
        assert_eq!(sweep_budget(16384), 16384);
        assert_eq!(sweep_budget(1 << 18), 1 << 18);
        assert_eq!(sweep_budget(1 << 20), 1 << 18);
        assert_eq!(sweep_budget(1 << 23), 1 << 21);
        assert_eq!(sweep_budget((1 << 20) + 1), (1 << 18) + 1);
        assert_eq!(sweep_budget((1 << 18) + 3), 1 << 18);
        assert!(new_subscriber() != 0);
    }
}
