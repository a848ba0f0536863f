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

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};

use ccm_codec::{encode_block_list, BlockAddress, BlockList, HotBlock, RelFork};

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

/// The mirror's maps hash with foldhash, seeded per map: several times faster than SipHash
/// on these 8-byte keys, and the keys come from our own nodes' buffer headers.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
type Set<K> = HashSet<K, foldhash::fast::RandomState>;

/// A block as the mirror keys it: its relation fork's number in [`Rels`] (high 32 bits) and
/// its block number. 8 bytes where a [`BlockAddress`] takes 20: the maps hold one entry per
/// block each node caches, millions at tens of GB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key(u64);

impl Key {
    fn new(rel: u32, block: u32) -> Key {
        Key(u64::from(rel) << 32 | u64::from(block))
    }

    fn rel(self) -> u32 {
        (self.0 >> 32) as u32
    }

    fn block(self) -> u32 {
        self.0 as u32
    }
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
    fn key(&mut self, addr: &BlockAddress) -> Key {
        if let Some(key) = self.get(addr) {
            return key;
        }
        let fork = addr.rel_fork();
        let id = u32::try_from(self.forks.len()).expect("fewer than 2^32 relation forks");
        self.forks.push(fork);
        self.ids.insert(fork, id);
        Key::new(id, addr.block)
    }

    /// The key of `addr` if its relation fork is numbered: a block of a fork never reported
    /// is in none of the maps, so a lookup need not number it.
    fn get(&self, addr: &BlockAddress) -> Option<Key> {
        let id = *self.ids.get(&addr.rel_fork())?;
        Some(Key::new(id, addr.block))
    }

    /// The address of a key this made.
    fn addr(&self, key: Key) -> BlockAddress {
        self.forks[key.rel() as usize].block(key.block())
    }
}

/// Which of the primary's sets a block is in: the hot set is sent every cycle, the colder
/// blocks only into a standby's unused buffers (fill_room).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Hot,
    Colder,
}

/// A block the primary caches: its reports per set and the usage count last reported. A
/// block is reported from two buffers at most for a sweep's length (it moved to a buffer
/// the sweep had passed), so 16 bits count far more than ever happens.
#[derive(Debug, Clone, Copy, Default)]
struct Cached {
    usage: u8,
    hot: u16,
    colder: u16,
}

impl Cached {
    fn class(&self) -> Option<Class> {
        if self.hot > 0 {
            Some(Class::Hot)
        } else if self.colder > 0 {
            Some(Class::Colder)
        } else {
            None
        }
    }

    fn count(&mut self, class: Class) -> &mut u16 {
        match class {
            Class::Hot => &mut self.hot,
            Class::Colder => &mut self.colder,
        }
    }
}

/// What the agent knows of one standby.
#[derive(Debug, Default)]
pub struct View {
    /// Every block its feed reports cached, with the number of its reports.
    cached: Map<Key, u32>,
    missing_hot: Set<Key>,
    missing_colder: Set<Key>,
    /// Sent and not reported yet, with its feed's full sweeps when sent.
    inflight: Map<Key, i64>,
    /// Its feed's full sweeps in its last answer.
    sweeps: i64,
    /// Its feed completed a full sweep since its last reset.
    pub complete: bool,
}

impl View {
    fn missing(&mut self, class: Class) -> &mut Set<Key> {
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
    fn miss_all(&mut self, primary: &Map<Key, Cached>) {
        self.forget_primary();
        for (addr, cached) in primary {
            if let Some(class) = cached.class() {
                if !self.cached.contains_key(addr) {
                    self.missing(class).insert(*addr);
                }
            }
        }
    }

    /// The primary's block `addr` went from set `before` to set `after`.
    fn reclassify(&mut self, addr: Key, before: Option<Class>, after: Option<Class>) {
        match (before, after) {
            (b, a) if b == a => {}
            (_, None) => {
                self.missing_hot.remove(&addr);
                self.missing_colder.remove(&addr);
                self.inflight.remove(&addr);
            }
            (None, Some(class)) => {
                if !self.cached.contains_key(&addr) && !self.inflight.contains_key(&addr) {
                    self.missing(class).insert(addr);
                }
            }
            (Some(from), Some(to)) => {
                if self.missing(from).remove(&addr) {
                    self.missing(to).insert(addr);
                }
            }
        }
    }
}

/// What the primary caches and every standby's view of it.
#[derive(Debug, Default)]
pub struct Mirror {
    rels: Rels,
    primary: Map<Key, Cached>,
    /// Blocks of `primary` in the hot set.
    hot: usize,
    /// The primary's feed completed a full sweep since its last reset.
    pub complete: bool,
    views: HashMap<String, View>,
}

impl Mirror {
    pub fn hot_len(&self) -> usize {
        self.hot
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
        let Some(addr) = key else {
            return;
        };
        let entry = self.primary.entry(addr).or_default();
        let before = entry.class();
        let count = entry.count(class);
        if up {
            *count = count.saturating_add(1);
            entry.usage = usage;
        } else {
            // Never below zero: a removal always follows its addition in the node's order.
            *count = count.saturating_sub(1);
        }
        let after = entry.class();
        if after.is_none() {
            self.primary.remove(&addr);
        }
        if (before == Some(Class::Hot)) != (after == Some(Class::Hot)) {
            if after == Some(Class::Hot) {
                self.hot += 1;
            } else {
                self.hot -= 1;
            }
        }
        for view in self.views.values_mut() {
            view.reclassify(addr, before, after);
        }
    }

    /// Applies the primary's answer.
    pub fn apply_primary(&mut self, answer: &FeedAnswer) {
        if answer.reset {
            self.primary.clear();
            self.hot = 0;
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
            let count = view.cached.entry(key).or_insert(0);
            *count += 1;
            if *count == 1 {
                view.missing_hot.remove(&key);
                view.missing_colder.remove(&key);
                view.inflight.remove(&key);
            }
        }
        for block in answer.removed.iter() {
            let Some(key) = rels.get(&block.addr) else {
                continue;
            };
            let Some(count) = view.cached.get_mut(&key) else {
                continue;
            };
            *count -= 1;
            if *count == 0 {
                view.cached.remove(&key);
                if let Some(class) = primary.get(&key).and_then(Cached::class) {
                    view.missing(class).insert(key);
                }
            }
        }
        // What was sent two full sweeps ago and is not reported goes out again.
        view.sweeps = answer.sweeps;
        let sweeps = answer.sweeps;
        let mut expired = Vec::new();
        view.inflight.retain(|key, sent_at| {
            let keep = sweeps < *sent_at + INFLIGHT_SWEEPS;
            if !keep {
                expired.push(*key);
            }
            keep
        });
        for key in expired {
            if let Some(class) = primary.get(&key).and_then(Cached::class) {
                view.missing(class).insert(key);
            }
        }
        view.complete |= answer.sweeps > 0;
    }

    /// Up to `limit` of standby `name`'s missing blocks of `class`, hottest first, as one
    /// list; they become inflight. None when nothing is missing.
    pub fn take_missing(&mut self, name: &str, class: Class, limit: usize) -> Option<BlockList> {
        self.view(name);
        let Mirror {
            rels,
            primary,
            views,
            hot,
            ..
        } = self;
        let view = views.get_mut(name).expect("made by view()");
        let sweeps = view.sweeps;
        let missing = view.missing(class);
        if missing.is_empty() || limit == 0 {
            return None;
        }
        let mut taken: Vec<(Key, HotBlock)> = missing
            .iter()
            .map(|&key| {
                let usage = primary.get(&key).map_or(0, |c| c.usage);
                (
                    key,
                    HotBlock {
                        addr: rels.addr(key),
                        usage,
                    },
                )
            })
            .collect();
        if taken.len() > limit {
            taken.select_nth_unstable_by(limit - 1, |(_, a), (_, b)| {
                b.usage.cmp(&a.usage).then(a.addr.cmp(&b.addr))
            });
            taken.truncate(limit);
        }
        for (key, _) in &taken {
            missing.remove(key);
        }
        view.inflight
            .extend(taken.iter().map(|&(key, _)| (key, sweeps)));
        let mut blocks: Vec<HotBlock> = taken.into_iter().map(|(_, block)| block).collect();
        let bytes =
            encode_block_list(&mut blocks, *hot as u64, 0).expect("addresses from valid lists");
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
                if view.inflight.remove(&key).is_some() {
                    if let Some(class) = primary.get(&key).and_then(Cached::class) {
                        view.missing(class).insert(key);
                    }
                }
            }
        }
    }

    /// Hot blocks standby `name` does not hold yet (missing, or sent and not reported).
    pub fn lacking(&self, name: &str) -> usize {
        self.views.get(name).map_or(self.hot, |v| {
            let inflight_hot = v
                .inflight
                .keys()
                .filter(|a| self.primary.get(a).and_then(Cached::class) == Some(Class::Hot))
                .count();
            v.missing_hot.len() + inflight_hot
        })
    }

    /// Whether standby `name`'s feed swept all its buffers since its last reset.
    pub fn standby_complete(&self, name: &str) -> bool {
        self.views.get(name).is_some_and(|v| v.complete)
    }

    /// Blocks sent to standby `name` that its feed has not reported yet: they may already
    /// take buffers its feed still counts as unused.
    pub fn inflight(&self, name: &str) -> usize {
        self.views.get(name).map_or(0, |v| v.inflight.len())
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
