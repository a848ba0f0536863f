//! An in-memory node for the cycle's unit tests (cycle_tests.rs): it answers the calls of
//! `NodeApi` the way a pg_ccm node does, from a few sets the test controls.
//!
//! A primary's buffer pool is its hot set (one relation's blocks with their usage counts);
//! a standby's is the set of blocks it caches, which `ccm_prewarm` adds to. Each node keeps
//! one change feed, with PostgreSQL's rules for a reset: another subscriber, a cursor that
//! is not the last answer's, or a first call. Every answer is a whole sweep. The test can
//! make a node refuse connections, go silent (every call and connection attempt hangs until
//! its deadline, as a frozen host would), promote it after some batches, or raise a
//! recovery conflict on its next batch. Nodes are found by `host:port`, so that the agent's
//! own connection strings reach them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use ccm_codec::{encode_block_list, BlockAddress, BlockList, HotBlock};
use tokio_util::sync::CancellationToken;

use crate::conninfo::{ConnInfo, HostSpec};
use crate::election::Holder;
use crate::feed::FeedAnswer;
use crate::node::{
    ConnectOptions, ErrorClass, NodeError, NodeFacts, PrewarmResult, Side, WalCacheStatus,
    WalSource,
};
use crate::nodeapi::NodeApi;
use crate::oscache::{Cursor, PrefetchResult, SliceAnswer};
use crate::report::CandidateRow;

/// What a fake server is; the test changes it while the agent runs.
#[derive(Debug, Default)]
pub struct Server {
    pub in_recovery: bool,
    pub system_identifier: String,
    pub shared_buffers: i64,
    pub timeline: u32,
    /// A standby's WAL sender.
    pub sender: Option<(String, u16)>,
    /// A primary's hot blocks (block number, usage count).
    pub hot: BTreeMap<u32, u8>,
    /// A standby's cached blocks.
    pub cached: BTreeSet<u32>,
    /// Blocks of its relation file in its page cache (the page-cache tier).
    pub os_cached: BTreeSet<u32>,
    pub refuse: bool,
    pub silent: bool,
    /// Promoted (out of recovery) once this many more batches were read.
    pub promote_after: Option<u32>,
    /// The next batch is cancelled by a recovery conflict.
    pub conflict_next: bool,
    /// Each batch takes this long (a slow disk).
    pub batch_delay: Duration,
    /// Each batch of the page-cache tier takes this long.
    pub os_delay: Duration,
    /// Its extension has no page-cache tier (before 0.9.0).
    pub no_os_cache: bool,
    /// Client sessions of its own readers running a query now (pg_stat_activity).
    pub busy_sessions: u64,
    /// Raised to close every session the server has (a restart of its network, say).
    pub generation: u32,
    pub connections: u32,
    /// The session holding the agents' advisory lock, and the generation it was made in.
    pub lock_holder: Option<(u64, u32)>,
    pub batches: u32,
    pub resets: u32,
    pub feed: Option<Feed>,
    /// The last candidate report an agent wrote to this primary (ccm_candidates): the
    /// agent's name, when its next report is due (ms) and its rows.
    pub candidates: Option<(String, i64, Vec<CandidateRow>)>,
}

#[derive(Debug)]
pub struct Feed {
    subscriber: i64,
    seq: i64,
    sweeps: i64,
    reported: BTreeSet<u32>,
}

type Shared = Arc<Mutex<Server>>;

static SESSIONS: AtomicU64 = AtomicU64::new(1000);

fn registry() -> MutexGuard<'static, HashMap<String, Shared>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Shared>>> = OnceLock::new();
    REGISTRY
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// A fake server at `127.0.0.1:port`; `port` must be unique among the tests.
pub fn server(port: u16, server: Server) -> Shared {
    let shared = Arc::new(Mutex::new(server));
    registry().insert(format!("127.0.0.1:{port}"), shared.clone());
    shared
}

/// A server's state, for the test to read or change.
pub fn lock(server: &Shared) -> MutexGuard<'_, Server> {
    server.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn addr(block: u32) -> BlockAddress {
    BlockAddress {
        spc: 1663,
        db: 5,
        rel: 16384,
        fork: 0,
        block,
    }
}

fn packed(blocks: impl Iterator<Item = (u32, u8)>) -> Vec<u8> {
    let mut hot: Vec<HotBlock> = blocks
        .map(|(b, usage)| HotBlock {
            addr: addr(b),
            usage,
        })
        .collect();
    encode_block_list(&mut hot, 0, 0).expect("a small list encodes")
}

fn list(blocks: impl Iterator<Item = (u32, u8)>) -> BlockList {
    BlockList::decode(&packed(blocks)).expect("it was just encoded")
}

/// A session on a fake server.
pub struct FakeNode {
    server: Shared,
    host: HostSpec,
    facts: NodeFacts,
    options: ConnectOptions,
    /// This session's number (a backend's pid, say).
    session: u64,
    generation: u32,
    closed: bool,
    feed_after: i64,
}

impl FakeNode {
    /// A silent server keeps the caller until the call's deadline (node.rs), which then
    /// ends the session.
    fn silence(&mut self) -> impl Future<Output = NodeError> + Send + 'static {
        self.closed = true;
        let (host, after) = (self.label(), self.options.call_deadline());
        async move {
            tokio::time::sleep(after).await;
            NodeError::QueryTimeout {
                host,
                what: "a call",
                after,
            }
        }
    }

    fn silent(&self) -> bool {
        lock(&self.server).silent
    }

    fn check_open(&self) -> Result<(), NodeError> {
        if self.is_closed() {
            return Err(NodeError::Socket {
                host: self.label(),
                error: std::io::ErrorKind::BrokenPipe.into(),
            });
        }
        Ok(())
    }
}

/// The error a fake server raises for `class`.
fn simulated(host: String, class: ErrorClass) -> NodeError {
    NodeError::Simulated { host, class }
}

impl NodeApi for FakeNode {
    async fn resolve(
        info: &ConnInfo,
        side: Side,
        options: ConnectOptions,
        cancel: &CancellationToken,
    ) -> Result<Self, NodeError> {
        let (mut tried, mut failures) = (Vec::new(), Vec::new());
        for host in info.hosts() {
            match Self::connect(info, &host, side, options, cancel).await {
                Ok(node) if node.facts.in_recovery == side.wants_recovery() => return Ok(node),
                Ok(node) => tried.push(format!("{} is {}", node.label(), side)),
                Err(e) => {
                    tried.push(e.to_string());
                    failures.push(e);
                }
            }
        }
        Err(NodeError::NoMatch {
            side,
            tried: tried.join("; "),
            failures,
        })
    }

    async fn connect(
        _info: &ConnInfo,
        host: &HostSpec,
        _side: Side,
        options: ConnectOptions,
        _cancel: &CancellationToken,
    ) -> Result<Self, NodeError> {
        let label = host.to_string();
        let server = registry().get(&label).cloned();
        let refused = || NodeError::Socket {
            host: label.clone(),
            error: std::io::ErrorKind::ConnectionRefused.into(),
        };
        let server = server.ok_or_else(refused)?;
        let (silent, refuse) = {
            let s = lock(&server);
            (s.silent, s.refuse)
        };
        if silent {
            tokio::time::sleep(options.connect_timeout).await;
            return Err(NodeError::ConnectTimeout {
                host: label,
                after: options.connect_timeout,
            });
        }
        if refuse {
            return Err(refused());
        }
        let (facts, generation) = {
            let mut s = lock(&server);
            s.connections += 1;
            let facts = NodeFacts {
                in_recovery: s.in_recovery,
                system_identifier: s.system_identifier.clone(),
                shared_buffers: s.shared_buffers,
                database: "postgres".into(),
                extension_version: Some("0.7.0".into()),
                server_version: "18.0".into(),
                library_version: Some("0.7.0".into()),
            };
            (facts, s.generation)
        };
        Ok(FakeNode {
            server,
            host: host.clone(),
            facts,
            options,
            session: SESSIONS.fetch_add(1, Ordering::Relaxed),
            generation,
            closed: false,
            feed_after: 0,
        })
    }

    fn facts(&self) -> &NodeFacts {
        &self.facts
    }

    fn host(&self) -> &HostSpec {
        &self.host
    }

    fn label(&self) -> String {
        self.host.to_string()
    }

    fn is_closed(&self) -> bool {
        self.closed || lock(&self.server).generation != self.generation
    }

    fn set_feed_after(&mut self, seq: i64) {
        self.feed_after = seq;
    }

    fn wire_bytes(&mut self) -> Option<(u64, u64)> {
        None
    }

    fn require_extension(&self) -> Result<(), NodeError> {
        Ok(())
    }

    fn catalog_behind(&self) -> Option<String> {
        None
    }

    fn has_change_feed(&self) -> bool {
        true
    }

    fn has_colder_feed(&self) -> bool {
        true
    }

    fn has_os_cache(&self) -> bool {
        !lock(&self.server).no_os_cache
    }

    async fn wal_source(&mut self) -> Result<WalSource, NodeError> {
        self.check_open()?;
        if self.silent() {
            return Err(self.silence().await);
        }
        let s = lock(&self.server);
        Ok(WalSource {
            in_recovery: s.in_recovery,
            timeline: Some(s.timeline),
            sender_host: s.sender.as_ref().map(|(h, _)| h.clone()),
            sender_port: s.sender.as_ref().map(|(_, p)| *p),
        })
    }

    async fn buffer_filter(&mut self, _fpr: f64) -> Result<(bool, Vec<u8>), NodeError> {
        Err(self.unsupported("ccm_buffer_filter()"))
    }

    async fn buffer_changes(
        &mut self,
        subscriber: i64,
        usage_threshold: Option<i32>,
        _max_buffers: i64,
        colder: bool,
    ) -> Result<(bool, FeedAnswer), NodeError> {
        self.check_open()?;
        if self.silent() {
            return Err(self.silence().await);
        }
        let after = self.feed_after;
        let mut guard = lock(&self.server);
        let s = &mut *guard;
        let now: BTreeMap<u32, u8> = if usage_threshold.is_some() {
            s.cached.iter().map(|&b| (b, 1)).collect()
        } else {
            s.hot.clone()
        };
        let reset_reason = match &s.feed {
            None => Some("new subscriber"),
            Some(f) if f.subscriber != subscriber => Some("new subscriber"),
            Some(f) if f.seq != after || after == 0 => Some("sequence mismatch"),
            Some(_) => None,
        };
        if reset_reason.is_some() {
            s.resets += 1;
            s.feed = Some(Feed {
                subscriber,
                seq: 0,
                sweeps: 0,
                reported: BTreeSet::new(),
            });
        }
        let feed = s.feed.as_mut().expect("set above");
        let added: Vec<(u32, u8)> = now
            .iter()
            .filter(|(b, _)| !feed.reported.contains(b))
            .map(|(&b, &u)| (b, u))
            .collect();
        let removed: Vec<(u32, u8)> = feed
            .reported
            .iter()
            .filter(|b| !now.contains_key(b))
            .map(|&b| (b, 0))
            .collect();
        feed.reported = now.keys().copied().collect();
        feed.seq += 1;
        feed.sweeps += 1;
        let empty = || Some(list(std::iter::empty()));
        let answer = FeedAnswer {
            seq: feed.seq,
            reset: reset_reason.is_some(),
            reset_reason: reset_reason.map(str::to_string),
            tracked: now.len() as i64,
            sweeps: feed.sweeps,
            visited: s.shared_buffers,
            added: list(added.into_iter()),
            removed: list(removed.into_iter()),
            colder_added: if colder { empty() } else { None },
            colder_removed: if colder { empty() } else { None },
        };
        Ok((s.in_recovery, answer))
    }

    async fn prewarm(&mut self, batch: &[u8]) -> Result<(bool, PrewarmResult), NodeError> {
        self.check_open()?;
        if self.silent() {
            return Err(self.silence().await);
        }
        let delay = lock(&self.server).batch_delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let list = BlockList::decode(batch).map_err(|e| self.unexpected(e.to_string()))?;
        let mut s = lock(&self.server);
        if std::mem::take(&mut s.conflict_next) {
            return Err(simulated(self.label(), ErrorClass::RecoveryConflict));
        }
        if !s.in_recovery {
            return Err(simulated(self.label(), ErrorClass::NotInRecovery));
        }
        s.batches += 1;
        let mut done = PrewarmResult {
            requested: list.len() as u64,
            replay_lag: Some(0),
            ..Default::default()
        };
        for block in list.iter() {
            if s.cached.insert(block.addr.block) {
                done.loaded += 1;
            } else {
                done.already_cached += 1;
            }
        }
        if let Some(left) = s.promote_after.as_mut() {
            *left = left.saturating_sub(1);
            if *left == 0 {
                s.in_recovery = false;
                s.promote_after = None;
            }
        }
        Ok((s.in_recovery, done))
    }

    async fn hot_blocks(
        &mut self,
        _filter: &[u8],
        _max_blocks: i64,
    ) -> Result<(bool, Vec<u8>), NodeError> {
        Err(self.unsupported("ccm_hot_blocks()"))
    }

    async fn hot_blocks_each(
        &mut self,
        _filters: &[Option<&[u8]>],
        _max_blocks: &[i64],
    ) -> Result<(bool, Vec<Vec<u8>>), NodeError> {
        Err(self.unsupported("ccm_hot_blocks_each()"))
    }

    async fn cached_blocks(
        &mut self,
        _filter: &[u8],
        _max_blocks: i64,
    ) -> Result<(bool, Vec<u8>), NodeError> {
        Err(self.unsupported("ccm_hot_blocks(..., 0)"))
    }

    async fn wal_cache(&mut self) -> Result<Option<WalCacheStatus>, NodeError> {
        Ok(None)
    }

    async fn try_agent_lock(&mut self) -> Result<bool, NodeError> {
        self.check_open()?;
        let mut s = lock(&self.server);
        // A session of an earlier generation is gone, and its lock with it.
        let generation = s.generation;
        let free = s.lock_holder.is_none_or(|(_, g)| g != generation);
        if free {
            s.lock_holder = Some((self.session, generation));
        }
        Ok(s.lock_holder == Some((self.session, generation)))
    }

    async fn agent_lock_holder(&mut self) -> Result<Option<Holder>, NodeError> {
        self.check_open()?;
        let s = lock(&self.server);
        Ok(s.lock_holder
            .filter(|(_, g)| *g == s.generation)
            .map(|(session, _)| Holder {
                pid: session as i32,
                application_name: Some("ccm-agent".into()),
                client_addr: Some("127.0.0.1".into()),
                client_port: None,
            }))
    }

    /// Its whole page cache in one slice.
    async fn os_cached_blocks(
        &mut self,
        _after: Cursor,
        _max_blocks: i64,
        _max_files: i32,
    ) -> Result<(bool, SliceAnswer), NodeError> {
        self.check_open()?;
        if self.silent() {
            return Err(self.silence().await);
        }
        let s = lock(&self.server);
        let answer = SliceAnswer {
            list: packed(s.os_cached.iter().map(|b| (*b, 0))),
            blocks: s.os_cached.len() as u64,
            last: Cursor::START,
            complete: true,
            in_play: true,
        };
        Ok((s.in_recovery, answer))
    }

    async fn os_prefetch(
        &mut self,
        list: &[u8],
        advise: bool,
    ) -> Result<(bool, PrefetchResult), NodeError> {
        self.check_open()?;
        if self.silent() {
            return Err(self.silence().await);
        }
        let delay = lock(&self.server).os_delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let list = BlockList::decode(list).map_err(|e| self.unexpected(e.to_string()))?;
        let mut s = lock(&self.server);
        if !s.in_recovery {
            return Err(simulated(self.label(), ErrorClass::NotInRecovery));
        }
        let mut done = PrefetchResult {
            requested: list.len() as u64,
            in_play: true,
            replay_lag: Some(0),
            ..Default::default()
        };
        for block in list.iter() {
            if s.os_cached.contains(&block.addr.block) {
                done.already_cached += 1;
            } else if advise {
                s.os_cached.insert(block.addr.block);
                done.advised += 1;
            }
        }
        Ok((s.in_recovery, done))
    }

    async fn busy_sessions(&mut self) -> Result<u64, NodeError> {
        self.check_open()?;
        if self.silent() {
            return Err(self.silence().await);
        }
        Ok(lock(&self.server).busy_sessions)
    }

    async fn report_candidates(
        &mut self,
        agent: &str,
        next_report_ms: i64,
        rows: &[CandidateRow],
    ) -> Result<bool, NodeError> {
        self.check_open()?;
        lock(&self.server).candidates = Some((agent.to_string(), next_report_ms, rows.to_vec()));
        Ok(true)
    }
}

impl Drop for FakeNode {
    /// A session's end releases its advisory lock, as PostgreSQL does.
    fn drop(&mut self) {
        let mut s = lock(&self.server);
        if s.lock_holder
            .is_some_and(|(session, _)| session == self.session)
        {
            s.lock_holder = None;
        }
    }
}

impl FakeNode {
    /// The filter exchange is not modelled: the cycle's tests run the change feed.
    fn unsupported(&self, what: &'static str) -> NodeError {
        NodeError::Unexpected {
            host: self.label(),
            what,
            detail: "a call the fake node does not model".into(),
        }
    }

    fn unexpected(&self, detail: String) -> NodeError {
        NodeError::Unexpected {
            host: self.label(),
            what: "ccm_prewarm()",
            detail,
        }
    }
}
