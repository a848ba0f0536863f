//! The agent's side of the change feed (extension 0.5.0, `ccm_buffer_changes()`): a mirror
//! of the primary's hot set and, per standby, which hot blocks it holds, lacks, or was sent
//! and has not yet confirmed.
//!
//! Every hot block is in exactly one of a standby's three sets:
//! - `have`: the standby's feed reported it (or its probe confirmed it): any later eviction
//!   will be reported by a later sweep;
//! - `missing`: to be sent;
//! - `inflight`: sent, to be probed by the standby's next feed call.
//!
//! Answers are applied in the order the node produced them: reset, removed, added, then the
//! probe. A node's answer with `reset` means the node forgot what it told us, so everything
//! we know from it goes (the primary: the hot set; a standby: what it holds). No work here is
//! proportional to the hot set in a steady cycle: sets change by what an answer lists.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};

use ccm_codec::{encode_block_list, BlockAddress, BlockList, HotBlock};

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
    pub present: Option<BlockList>,
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
/// else a third (at least 2^18), so that a full sweep takes at most three cycles.
pub fn sweep_budget(buffers: i64) -> i64 {
    const SMALL: i64 = 1 << 18;
    if buffers <= SMALL {
        buffers.max(0)
    } else {
        ((buffers + 2) / 3).max(SMALL)
    }
}

/// What the agent knows of one standby.
#[derive(Debug, Default)]
pub struct View {
    have: HashSet<BlockAddress>,
    missing: HashSet<BlockAddress>,
    inflight: HashSet<BlockAddress>,
    /// Its feed completed a full sweep since its last reset.
    pub complete: bool,
}

/// The primary's hot set and every standby's view of it.
#[derive(Debug, Default)]
pub struct Mirror {
    hot: HashMap<BlockAddress, u8>,
    /// The primary's feed completed a full sweep since its last reset.
    pub complete: bool,
    views: HashMap<String, View>,
}

impl Mirror {
    pub fn hot_len(&self) -> usize {
        self.hot.len()
    }

    fn view(&mut self, name: &str) -> &mut View {
        if !self.views.contains_key(name) {
            // A new standby lacks every hot block until its feed says otherwise.
            let view = View {
                missing: self.hot.keys().copied().collect(),
                ..View::default()
            };
            self.views.insert(name.to_string(), view);
        }
        self.views.get_mut(name).expect("inserted above")
    }

    /// Forgets standbys that are no longer in the topology.
    pub fn retain_standbys(&mut self, names: &[String]) {
        self.views.retain(|name, _| names.contains(name));
    }

    /// Applies the primary's answer.
    pub fn apply_primary(&mut self, answer: &FeedAnswer) {
        if answer.reset {
            self.hot.clear();
            for view in self.views.values_mut() {
                view.have.clear();
                view.missing.clear();
                view.inflight.clear();
            }
            self.complete = false;
        }
        for block in answer.removed.iter() {
            if self.hot.remove(&block.addr).is_some() {
                for view in self.views.values_mut() {
                    view.have.remove(&block.addr);
                    view.missing.remove(&block.addr);
                    view.inflight.remove(&block.addr);
                }
            }
        }
        for block in answer.added.iter() {
            if self.hot.insert(block.addr, block.usage).is_none() {
                for view in self.views.values_mut() {
                    view.missing.insert(block.addr);
                }
            }
        }
        self.complete |= answer.sweeps > 0;
    }

    /// Applies standby `name`'s answer (its probe answered for its inflight blocks).
    pub fn apply_standby(&mut self, name: &str, answer: &FeedAnswer) {
        self.view(name);
        let Mirror { hot, views, .. } = self;
        let view = views.get_mut(name).expect("made by view()");
        if answer.reset {
            view.missing.extend(view.have.drain());
            view.missing.extend(view.inflight.drain());
            view.complete = false;
        }
        for block in answer.removed.iter() {
            if view.have.remove(&block.addr) {
                view.missing.insert(block.addr);
            }
        }
        for block in answer.added.iter() {
            if hot.contains_key(&block.addr)
                && (view.missing.remove(&block.addr) || view.inflight.remove(&block.addr))
            {
                view.have.insert(block.addr);
            }
        }
        if let Some(present) = &answer.present {
            for block in present.iter() {
                if view.inflight.remove(&block.addr) {
                    view.have.insert(block.addr);
                }
            }
        }
        // What was probed and not found held goes out again.
        if answer.present.is_some() {
            view.missing.extend(view.inflight.drain());
        }
        view.complete |= answer.sweeps > 0;
    }

    /// The probe for standby `name`: its inflight blocks, or None when there are none.
    pub fn probe(&mut self, name: &str) -> Option<Vec<u8>> {
        let view = self.view(name);
        if view.inflight.is_empty() {
            return None;
        }
        let mut blocks: Vec<HotBlock> = view
            .inflight
            .iter()
            .map(|&addr| HotBlock { addr, usage: 0 })
            .collect();
        Some(encode_block_list(&mut blocks, 0, 0).expect("addresses from valid lists"))
    }

    /// Up to `limit` of standby `name`'s missing blocks, hottest first, as one list; they
    /// become inflight. None when nothing is missing.
    pub fn take_missing(&mut self, name: &str, limit: usize) -> Option<BlockList> {
        self.view(name);
        let Mirror { hot, views, .. } = self;
        let view = views.get_mut(name).expect("made by view()");
        if view.missing.is_empty() || limit == 0 {
            return None;
        }
        let mut blocks: Vec<HotBlock> = view
            .missing
            .iter()
            .map(|&addr| HotBlock {
                addr,
                usage: hot.get(&addr).copied().unwrap_or(0),
            })
            .collect();
        if blocks.len() > limit {
            blocks.select_nth_unstable_by(limit - 1, |a, b| {
                b.usage.cmp(&a.usage).then(a.addr.cmp(&b.addr))
            });
            blocks.truncate(limit);
        }
        for block in &blocks {
            view.missing.remove(&block.addr);
            view.inflight.insert(block.addr);
        }
        let bytes = encode_block_list(&mut blocks, hot.len() as u64, 0)
            .expect("addresses from valid lists");
        Some(BlockList::decode(&bytes).expect("a list we just encoded"))
    }

    /// Hot blocks standby `name` does not hold yet (missing or unconfirmed).
    pub fn lacking(&self, name: &str) -> usize {
        self.views
            .get(name)
            .map_or(self.hot.len(), |v| v.missing.len() + v.inflight.len())
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

    fn list(blocks: &[(u32, u8)]) -> BlockList {
        let mut hot: Vec<HotBlock> = blocks
            .iter()
            .map(|&(b, usage)| HotBlock {
                addr: addr(b),
                usage,
            })
            .collect();
        BlockList::decode(&encode_block_list(&mut hot, 0, 0).unwrap()).unwrap()
    }

    fn answer(
        reset: bool,
        added: &[(u32, u8)],
        removed: &[u32],
        present: Option<&[u32]>,
    ) -> FeedAnswer {
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
            present: present.map(|p| list(&p.iter().map(|&b| (b, 0)).collect::<Vec<_>>())),
        }
    }

    fn sent(m: &mut Mirror, name: &str) -> Vec<u32> {
        m.take_missing(name, usize::MAX)
            .map_or(vec![], |l| l.iter().map(|b| b.addr.block).collect())
    }

    #[test]
    fn hot_blocks_are_sent_hottest_first_and_confirmed_by_the_feed() {
        let mut m = Mirror::default();
        m.apply_standby("s", &answer(true, &[], &[], None));
        m.apply_primary(&answer(true, &[(1, 4), (2, 5), (3, 4)], &[], None));
        let first = m.take_missing("s", 1).unwrap();
        assert_eq!(
            first.iter().map(|b| b.addr.block).collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(sent(&mut m, "s"), vec![1, 3]);
        assert_eq!(m.lacking("s"), 3);
        // The standby's sweep reports 1 and 2; 3 is probed and was not loaded.
        m.apply_standby("s", &answer(false, &[(1, 4), (2, 5)], &[], Some(&[])));
        assert_eq!(m.lacking("s"), 1);
        assert_eq!(sent(&mut m, "s"), vec![3]);
    }

    #[test]
    fn a_block_held_before_it_became_hot_is_confirmed_by_the_probe() {
        let mut m = Mirror::default();
        m.apply_standby("s", &answer(true, &[(7, 1)], &[], None)); // cached, not hot yet
        m.apply_primary(&answer(true, &[(7, 5)], &[], None));
        assert_eq!(sent(&mut m, "s"), vec![7]);
        assert_eq!(
            m.probe("s").map(|p| BlockList::decode(&p).unwrap().len()),
            Some(1)
        );
        m.apply_standby("s", &answer(false, &[], &[], Some(&[7])));
        assert_eq!(m.lacking("s"), 0);
        assert_eq!(m.probe("s"), None);
    }

    #[test]
    fn an_eviction_on_the_standby_sends_the_block_again() {
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5)], &[], None));
        m.apply_standby("s", &answer(true, &[(1, 5)], &[], None));
        assert_eq!(m.lacking("s"), 0);
        m.apply_standby("s", &answer(false, &[(9, 1)], &[1], None));
        assert_eq!(sent(&mut m, "s"), vec![1]);
    }

    #[test]
    fn a_block_that_cools_on_the_primary_is_no_longer_counted() {
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5), (2, 5)], &[], None));
        m.apply_standby("s", &answer(true, &[(1, 5)], &[], None));
        m.apply_primary(&answer(false, &[], &[2], None));
        assert_eq!((m.hot_len(), m.lacking("s")), (1, 0));
    }

    #[test]
    fn resets_forget_what_the_node_told() {
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5), (2, 5)], &[], None));
        m.apply_standby("s", &answer(true, &[(1, 5), (2, 5)], &[], None));
        assert_eq!(m.lacking("s"), 0);
        // The standby restarted: it may hold nothing.
        m.apply_standby("s", &answer(true, &[(2, 5)], &[], None));
        assert_eq!(sent(&mut m, "s"), vec![1]);
        // The primary's feed started over: the hot set is rebuilt from its answers.
        m.apply_primary(&answer(true, &[(3, 5)], &[], None));
        assert_eq!((m.hot_len(), m.lacking("s")), (1, 1));
    }

    #[test]
    fn a_new_standby_lacks_the_whole_hot_set() {
        let mut m = Mirror::default();
        m.apply_primary(&answer(true, &[(1, 5), (2, 4)], &[], None));
        assert_eq!(m.lacking("new"), 2);
        assert_eq!(sent(&mut m, "new"), vec![1, 2]);
        m.retain_standbys(&[]);
        assert_eq!(m.lacking("new"), 2);
    }

    #[test]
    fn sweep_budget_covers_small_pools_whole_and_large_ones_in_three() {
        assert_eq!(sweep_budget(16384), 16384);
        assert_eq!(sweep_budget(1 << 18), 1 << 18);
        assert_eq!(sweep_budget(1 << 20), 349_526);
        assert_eq!(sweep_budget((1 << 18) + 3), 1 << 18);
        assert!(new_subscriber() != 0);
    }
}
