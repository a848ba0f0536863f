//! What the sync cycle asks of a node, as a trait: a real session (node.rs) in the agent, an
//! in-memory node (fake.rs) in the cycle's unit tests.
//!
//! The cycle's orchestration (which standby is served when, what a promotion, a recovery
//! conflict, a silent node or a feed reset does to the rest of the cycle) is where its bugs
//! would be, and without this trait only the integration tests reached it. The trait holds
//! exactly the calls sync.rs and standby.rs make; node.rs keeps the SQL, the deadlines and
//! the error classes.

use std::future::Future;

use tokio_util::sync::CancellationToken;

use crate::conninfo::{ConnInfo, HostSpec};
use crate::election::Holder;
use crate::feed::FeedAnswer;
use crate::node::{
    self, ConnectOptions, Node, NodeError, NodeFacts, PrewarmResult, Side, WalCacheStatus,
    WalSource,
};
use crate::oscache::{Cursor, PrefetchResult, SliceAnswer};
use crate::report::CandidateRow;

/// A session on one node, as the cycle uses it.
pub trait NodeApi: Send + Sized + 'static {
    /// Connects to the hosts of `info` in order and returns the first whose role fits `side`
    /// and that has the extension.
    fn resolve(
        info: &ConnInfo,
        side: Side,
        options: ConnectOptions,
        cancel: &CancellationToken,
    ) -> impl Future<Output = Result<Self, NodeError>> + Send;

    /// Connects to one host, whatever its role.
    fn connect(
        info: &ConnInfo,
        host: &HostSpec,
        side: Side,
        options: ConnectOptions,
        cancel: &CancellationToken,
    ) -> impl Future<Output = Result<Self, NodeError>> + Send;

    fn facts(&self) -> &NodeFacts;
    fn host(&self) -> &HostSpec;
    fn label(&self) -> String;
    fn is_closed(&self) -> bool;
    /// Sets the change feed's cursor: the seq of the last answer applied (0: none).
    fn set_feed_after(&mut self, seq: i64);
    /// Bytes the session sent and received since the last call.
    fn wire_bytes(&mut self) -> Option<(u64, u64)>;
    fn require_extension(&self) -> Result<(), NodeError>;
    fn catalog_behind(&self) -> Option<String>;
    fn has_change_feed(&self) -> bool;
    fn has_colder_feed(&self) -> bool;
    /// Whether it has the page-cache tier (extension 0.9.0).
    fn has_os_cache(&self) -> bool;

    fn wal_source(&mut self) -> impl Future<Output = Result<WalSource, NodeError>> + Send;
    fn buffer_filter(
        &mut self,
        false_positive_rate: f64,
    ) -> impl Future<Output = Result<(bool, Vec<u8>), NodeError>> + Send;
    fn buffer_changes(
        &mut self,
        subscriber: i64,
        usage_threshold: Option<i32>,
        max_buffers: i64,
        colder: bool,
    ) -> impl Future<Output = Result<(bool, FeedAnswer), NodeError>> + Send;
    fn prewarm(
        &mut self,
        list: &[u8],
    ) -> impl Future<Output = Result<(bool, PrewarmResult), NodeError>> + Send;
    fn hot_blocks(
        &mut self,
        filter: &[u8],
        max_blocks: i64,
    ) -> impl Future<Output = Result<(bool, Vec<u8>), NodeError>> + Send;
    fn hot_blocks_each(
        &mut self,
        filters: &[Option<&[u8]>],
        max_blocks: &[i64],
    ) -> impl Future<Output = Result<(bool, Vec<Vec<u8>>), NodeError>> + Send;
    fn cached_blocks(
        &mut self,
        filter: &[u8],
        max_blocks: i64,
    ) -> impl Future<Output = Result<(bool, Vec<u8>), NodeError>> + Send;
    fn wal_cache(
        &mut self,
    ) -> impl Future<Output = Result<Option<WalCacheStatus>, NodeError>> + Send;
    /// The slice of its page cache after the cursor (oscache.rs).
    fn os_cached_blocks(
        &mut self,
        after: Cursor,
        max_blocks: i64,
        max_files: i32,
    ) -> impl Future<Output = Result<(bool, SliceAnswer), NodeError>> + Send;
    /// Standby: reads what it lacks of `list` into its page cache, or only counts it.
    fn os_prefetch(
        &mut self,
        list: &[u8],
        advise: bool,
    ) -> impl Future<Output = Result<(bool, PrefetchResult), NodeError>> + Send;
    /// Standby: its client sessions other than the agent's running a query now.
    fn busy_sessions(&mut self) -> impl Future<Output = Result<u64, NodeError>> + Send;
    /// Primary: tries the agents' advisory lock (election.rs); true when held now.
    fn try_agent_lock(&mut self) -> impl Future<Output = Result<bool, NodeError>> + Send;
    /// Primary: the session holding the agents' lock, if any.
    fn agent_lock_holder(
        &mut self,
    ) -> impl Future<Output = Result<Option<Holder>, NodeError>> + Send;
    /// Primary: records the agent's report of the candidates (`ccm_candidates`), the next due
    /// within `next_report_ms`; false when its catalog has no such function (before 0.8.0),
    /// and nothing was sent.
    fn report_candidates(
        &mut self,
        agent: &str,
        next_report_ms: i64,
        rows: &[CandidateRow],
    ) -> impl Future<Output = Result<bool, NodeError>> + Send;
}

impl NodeApi for Node {
    fn resolve(
        info: &ConnInfo,
        side: Side,
        options: ConnectOptions,
        cancel: &CancellationToken,
    ) -> impl Future<Output = Result<Self, NodeError>> + Send {
        node::resolve(info, side, options, cancel, true)
    }

    fn connect(
        info: &ConnInfo,
        host: &HostSpec,
        side: Side,
        options: ConnectOptions,
        cancel: &CancellationToken,
    ) -> impl Future<Output = Result<Self, NodeError>> + Send {
        Node::connect(info, host, side, options, cancel)
    }

    fn facts(&self) -> &NodeFacts {
        &self.facts
    }

    fn host(&self) -> &HostSpec {
        &self.host
    }

    fn label(&self) -> String {
        Node::label(self)
    }

    fn is_closed(&self) -> bool {
        Node::is_closed(self)
    }

    fn set_feed_after(&mut self, seq: i64) {
        self.feed_after = seq;
    }

    fn wire_bytes(&mut self) -> Option<(u64, u64)> {
        Node::wire_bytes(self)
    }

    fn require_extension(&self) -> Result<(), NodeError> {
        Node::require_extension(self)
    }

    fn catalog_behind(&self) -> Option<String> {
        Node::catalog_behind(self)
    }

    fn has_change_feed(&self) -> bool {
        Node::has_change_feed(self)
    }

    fn has_colder_feed(&self) -> bool {
        Node::has_colder_feed(self)
    }

    fn has_os_cache(&self) -> bool {
        Node::has_os_cache(self)
    }

    fn wal_source(&mut self) -> impl Future<Output = Result<WalSource, NodeError>> + Send {
        Node::wal_source(self)
    }

    fn buffer_filter(
        &mut self,
        false_positive_rate: f64,
    ) -> impl Future<Output = Result<(bool, Vec<u8>), NodeError>> + Send {
        Node::buffer_filter(self, false_positive_rate)
    }

    fn buffer_changes(
        &mut self,
        subscriber: i64,
        usage_threshold: Option<i32>,
        max_buffers: i64,
        colder: bool,
    ) -> impl Future<Output = Result<(bool, FeedAnswer), NodeError>> + Send {
        Node::buffer_changes(self, subscriber, usage_threshold, max_buffers, colder)
    }

    fn prewarm(
        &mut self,
        list: &[u8],
    ) -> impl Future<Output = Result<(bool, PrewarmResult), NodeError>> + Send {
        Node::prewarm(self, list)
    }

    fn hot_blocks(
        &mut self,
        filter: &[u8],
        max_blocks: i64,
    ) -> impl Future<Output = Result<(bool, Vec<u8>), NodeError>> + Send {
        Node::hot_blocks(self, filter, max_blocks)
    }

    fn hot_blocks_each(
        &mut self,
        filters: &[Option<&[u8]>],
        max_blocks: &[i64],
    ) -> impl Future<Output = Result<(bool, Vec<Vec<u8>>), NodeError>> + Send {
        Node::hot_blocks_each(self, filters, max_blocks)
    }

    fn cached_blocks(
        &mut self,
        filter: &[u8],
        max_blocks: i64,
    ) -> impl Future<Output = Result<(bool, Vec<u8>), NodeError>> + Send {
        Node::cached_blocks(self, filter, max_blocks)
    }

    fn wal_cache(
        &mut self,
    ) -> impl Future<Output = Result<Option<WalCacheStatus>, NodeError>> + Send {
        Node::wal_cache(self)
    }

    fn os_cached_blocks(
        &mut self,
        after: Cursor,
        max_blocks: i64,
        max_files: i32,
    ) -> impl Future<Output = Result<(bool, SliceAnswer), NodeError>> + Send {
        Node::os_cached_blocks(self, after, max_blocks, max_files)
    }

    fn os_prefetch(
        &mut self,
        list: &[u8],
        advise: bool,
    ) -> impl Future<Output = Result<(bool, PrefetchResult), NodeError>> + Send {
        Node::os_prefetch(self, list, advise)
    }

    fn busy_sessions(&mut self) -> impl Future<Output = Result<u64, NodeError>> + Send {
        Node::busy_sessions(self)
    }

    fn try_agent_lock(&mut self) -> impl Future<Output = Result<bool, NodeError>> + Send {
        Node::try_agent_lock(self)
    }

    fn agent_lock_holder(
        &mut self,
    ) -> impl Future<Output = Result<Option<Holder>, NodeError>> + Send {
        Node::agent_lock_holder(self)
    }

    fn report_candidates(
        &mut self,
        agent: &str,
        next_report_ms: i64,
        rows: &[CandidateRow],
    ) -> impl Future<Output = Result<bool, NodeError>> + Send {
        Node::report_candidates(self, agent, next_report_ms, rows)
    }
}
