//! Which node is the primary and which standbys are warmed, in which order.
//!
//! Without Patroni the two connection strings say it: the primary string is resolved by
//! role as libpq's `target_session_attrs` would, and every host of the standby string is a
//! target, in the order given (a host that turns out to be the primary, or down, is passed
//! over for that cycle). With `--patroni` the REST API's `GET /cluster` says it, every
//! cycle: the leader is the primary, and the members that may become leader are the
//! targets, in Patroni's `failover_priority` order; `nofailover` members are left alone
//! unless `warm_nofailover` is set; the caller's Patroni client (the sync loop's, the status
//! looker's) asks the REST API URL that answered last first (patroni.rs). Either way the agent still checks
//! every node's role, system identifier and timeline itself (sync.rs): Patroni's word is a
//! map, not a proof.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::conninfo::ConnInfo;
use crate::patroni::{self, PatroniError};

/// A standby to warm.
#[derive(Debug, Clone)]
pub struct Target {
    /// Its name in logs, metrics and `wait --member`: Patroni's member name, else host:port.
    pub name: String,
    /// A single-host connection string.
    pub conninfo: ConnInfo,
}

/// The cluster as the agent is to see it this cycle.
#[derive(Debug, Clone)]
pub struct Topology {
    /// The primary's connection string (several hosts: the one not in recovery is used).
    pub primary: ConnInfo,
    /// Patroni's leader, by name (None without Patroni).
    pub leader: Option<String>,
    /// The standbys to warm, first to last.
    pub targets: Vec<Target>,
    /// Patroni members not warmed, and why.
    pub excluded: Vec<(String, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("{0}")]
    Patroni(#[from] PatroniError),
    #[error("Patroni ({url}) reports no leader; waiting for one")]
    NoLeader { url: String },
    #[error("Patroni ({url}) reports the leader {name} without a host and port")]
    LeaderWithoutAddress { url: String, name: String },
}

/// The topology this cycle, from the configuration or from Patroni through `client`, which
/// the caller keeps from call to call: it asks the REST API URL that answered last first, so
/// a member that is down costs its timeout once, not on every call.
pub async fn discover(
    cfg: &Config,
    client: &patroni::Client,
    timeout: Duration,
    cancel: &CancellationToken,
) -> Result<Topology, TopologyError> {
    let Some(source) = &cfg.patroni else {
        return Ok(from_conninfo(cfg));
    };
    let cluster = client
        .fetch_cluster(&source.urls, &source.tls, timeout, cancel)
        .await?;
    from_patroni(&cluster, &source.member, source.warm_nofailover)
}

/// Every host of the standby string, in its order.
pub fn from_conninfo(cfg: &Config) -> Topology {
    let targets = cfg
        .standby
        .hosts()
        .iter()
        .map(|host| Target {
            name: host.to_string(),
            conninfo: cfg.standby.only(host),
        })
        .collect();
    Topology {
        primary: cfg.primary.clone(),
        leader: None,
        targets,
        excluded: Vec::new(),
    }
}

/// The leader and the failover candidates of a Patroni cluster.
pub fn from_patroni(
    cluster: &patroni::Cluster,
    member: &ConnInfo,
    warm_nofailover: bool,
) -> Result<Topology, TopologyError> {
    let leader = cluster.leader().ok_or_else(|| TopologyError::NoLeader {
        url: cluster.source.clone(),
    })?;
    let (Some(host), Some(port)) = (&leader.host, leader.port) else {
        return Err(TopologyError::LeaderWithoutAddress {
            url: cluster.source.clone(),
            name: leader.name.clone(),
        });
    };
    let targets = cluster
        .candidates(warm_nofailover)
        .into_iter()
        .filter_map(|m| {
            let (host, port) = (m.host.as_ref()?, m.port?);
            Some(Target {
                name: m.name.clone(),
                conninfo: member.at(host, port),
            })
        })
        .collect();
    let excluded = cluster
        .excluded(warm_nofailover)
        .into_iter()
        .filter(|(m, _)| m.name != leader.name)
        .map(|(m, why)| (m.name.clone(), why.to_string()))
        .collect();
    Ok(Topology {
        primary: member.at(host, port),
        leader: Some(leader.name.clone()),
        targets,
        excluded,
    })
}
