//! The WAL-sender check: is the node a standby streams from one of this cluster's? (review M3)
//!
//! A standby is warmed only when it shares the primary's system identifier and streams its
//! timeline (sync.rs). That proves it follows this cluster's history, not which node it
//! follows: after a split brain on one timeline number (two standbys of a dead primary both
//! promoted) only the WAL sender tells. `ccm_wal_source()` names the sender as the standby's
//! `primary_conninfo` does, and this module compares it with the nodes the agent knows:
//!
//! - the primary, or a standby being warmed (a cascade): a **member**, warmed;
//! - another node the agent knows (a host of the standby string, or a Patroni member, that is
//!   not a standby of this primary, such as a promoted one): **foreign**, never warmed;
//! - nothing the agent knows: **unknown**. That is what a standby streaming through a virtual
//!   IP, a Kubernetes Service (CloudNativePG's `<cluster>-rw`) or a proxy reports, and what a
//!   name resolved differently here looks like. The system identifier and the timeline already
//!   hold, so `wal_sender_check = warn` (the default) warms it and warns once per standby and
//!   sender; `strict` refuses it, as the agent did before 0.7; `off` skips the comparison.
//!
//! Names are compared first (a Unix-socket sender by its port only: a server on the agent's
//! machine); only when no name matches are the addresses resolved, the primary's again too, so
//! that a DNS failure when the primary session was made does not make its standbys foreign.
//! The comparison is pure (`classify`, `verdict`); the lookups are the caller's.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// `wal_sender_check`: what to do with a standby whose WAL sender is no node the agent knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SenderCheck {
    /// Warm it, with a warning (the sender may be a virtual IP, a Service or a proxy).
    Warn,
    /// Do not warm it.
    Strict,
    /// Do not compare senders at all: the system identifier and the timeline decide.
    Off,
}

/// A node as a sender or as one the agent knows: its host name (or socket directory), port
/// and, once resolved, addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub name: String,
    pub port: u16,
    pub addrs: Vec<IpAddr>,
}

impl Endpoint {
    pub fn new(name: impl Into<String>, port: u16) -> Self {
        Endpoint {
            name: name.into(),
            port,
            addrs: Vec::new(),
        }
    }

    /// A Unix-socket directory, not a host name: never resolved.
    pub fn is_socket(&self) -> bool {
        self.name.starts_with('/')
    }

    fn same_as(&self, known: &Endpoint) -> bool {
        if self.port != known.port {
            return false;
        }
        if self.is_socket() {
            return true;
        }
        self.name.eq_ignore_ascii_case(&known.name)
            || self.addrs.iter().any(|a| known.addrs.contains(a))
    }
}

/// Where a sender stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sender {
    Member,
    /// A node the agent knows that is not a member: its name.
    Foreign(String),
    Unknown,
}

/// The sender against the members (the primary, the standbys being warmed) and the other
/// nodes the agent knows. A member match wins: the same node may be listed twice.
pub fn classify(sender: &Endpoint, members: &[Endpoint], others: &[Endpoint]) -> Sender {
    if members.iter().any(|m| sender.same_as(m)) {
        return Sender::Member;
    }
    match others.iter().find(|o| sender.same_as(o)) {
        Some(other) => Sender::Foreign(format!("{}:{}", other.name, other.port)),
        None => Sender::Unknown,
    }
}

/// What the cycle does with the standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Warm,
    /// Warm it, and say why it is warmed although its sender is unknown.
    WarmUnknown,
    Refuse,
}

pub fn verdict(sender: &Sender, check: SenderCheck) -> Verdict {
    match (sender, check) {
        (_, SenderCheck::Off) | (Sender::Member, _) => Verdict::Warm,
        (Sender::Foreign(_), _) | (Sender::Unknown, SenderCheck::Strict) => Verdict::Refuse,
        (Sender::Unknown, SenderCheck::Warn) => Verdict::WarmUnknown,
    }
}

/// How long an unknown sender's verdict is kept before its names are resolved again.
pub const UNKNOWN_KEPT: Duration = Duration::from_secs(60);

/// Unknown senders already looked up (so a standby behind a virtual IP costs no DNS lookup
/// every cycle) and warned about (once per standby and sender).
#[derive(Debug, Default)]
pub struct Unknowns {
    seen: HashMap<(String, String, u16), Instant>,
}

impl Unknowns {
    /// Whether `standby`'s sender was found unknown within UNKNOWN_KEPT of `now`.
    pub fn recent(&self, standby: &str, sender: &Endpoint, now: Instant) -> bool {
        self.seen
            .get(&key(standby, sender))
            .is_some_and(|at| now.saturating_duration_since(*at) < UNKNOWN_KEPT)
    }

    /// Records an unknown sender; true the first time for this standby and sender (warn).
    pub fn record(&mut self, standby: &str, sender: &Endpoint, now: Instant) -> bool {
        self.seen.insert(key(standby, sender), now).is_none()
    }

    /// Forgets `standby` (its sender changed or it went away), so a return is told again.
    pub fn forget(&mut self, standby: &str) {
        self.seen.retain(|(name, _, _), _| name != standby);
    }
}

fn key(standby: &str, sender: &Endpoint) -> (String, String, u16) {
    (standby.to_string(), sender.name.clone(), sender.port)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(name: &str, port: u16, addrs: &[&str]) -> Endpoint {
        Endpoint {
            name: name.to_string(),
            port,
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn members_by_name_or_address() {
        let members = [at("db1", 5432, &["10.0.0.1"]), at("db2", 5432, &[])];
        for (sender, expected) in [
            (at("db1", 5432, &[]), Sender::Member),
            (at("DB1", 5432, &[]), Sender::Member),
            (at("db2", 5432, &[]), Sender::Member),
            // An IP address of the primary, resolved.
            (at("10.0.0.1", 5432, &["10.0.0.1"]), Sender::Member),
            // The right name on another port is another server.
            (at("db1", 5433, &[]), Sender::Unknown),
            // A Unix socket: a server on this machine, told apart by its port.
            (at("/var/run/postgresql", 5432, &[]), Sender::Member),
            (at("/tmp", 6000, &[]), Sender::Unknown),
        ] {
            assert_eq!(classify(&sender, &members, &[]), expected, "{sender:?}");
        }
    }

    #[test]
    fn a_known_node_that_is_no_member_is_foreign() {
        // The split brain of test_multi_standby.py: the sender is A, a host of the standby
        // string that was promoted; the primary is C.
        let members = [at("127.0.0.1", 6003, &["127.0.0.1"])];
        let others = [at("127.0.0.1", 6001, &["127.0.0.1"])];
        let sender = at("127.0.0.1", 6001, &["127.0.0.1"]);
        assert_eq!(
            classify(&sender, &members, &others),
            Sender::Foreign("127.0.0.1:6001".into())
        );
        assert_eq!(
            verdict(&classify(&sender, &members, &others), SenderCheck::Warn),
            Verdict::Refuse
        );
        // Listed both ways (a host of the standby string that is a member): a member.
        let members = [at("db2", 5432, &[])];
        let others = [at("db2", 5432, &[])];
        assert_eq!(
            classify(&at("db2", 5432, &[]), &members, &others),
            Sender::Member
        );
    }

    #[test]
    fn a_virtual_ip_or_service_is_unknown_and_warmed_with_a_warning() {
        // CloudNativePG: replicas stream from pg-rw, a Service whose address is no node's.
        let members = [
            at("pg-1.pg", 5432, &["10.1.0.11"]),
            at("pg-2.pg", 5432, &[]),
        ];
        let others = [at("pg-3.pg", 5432, &["10.1.0.13"])];
        let service = at("pg-rw", 5432, &["10.96.0.20"]);
        let sender = classify(&service, &members, &others);
        assert_eq!(sender, Sender::Unknown);
        assert_eq!(verdict(&sender, SenderCheck::Warn), Verdict::WarmUnknown);
        assert_eq!(verdict(&sender, SenderCheck::Strict), Verdict::Refuse);
        assert_eq!(verdict(&sender, SenderCheck::Off), Verdict::Warm);
        // Resolved to the primary's address after all (a DNS failure at connect time).
        let resolved = at("pg-rw", 5432, &["10.1.0.11"]);
        assert_eq!(classify(&resolved, &members, &others), Sender::Member);
    }

    #[test]
    fn verdicts() {
        for check in [SenderCheck::Warn, SenderCheck::Strict, SenderCheck::Off] {
            assert_eq!(verdict(&Sender::Member, check), Verdict::Warm);
        }
        let foreign = Sender::Foreign("a:1".into());
        assert_eq!(verdict(&foreign, SenderCheck::Strict), Verdict::Refuse);
        assert_eq!(verdict(&foreign, SenderCheck::Off), Verdict::Warm);
    }

    #[test]
    fn unknown_senders_are_warned_once_and_looked_up_again_later() {
        let mut unknowns = Unknowns::default();
        let sender = at("pg-rw", 5432, &[]);
        let now = Instant::now();
        assert!(!unknowns.recent("s1", &sender, now));
        assert!(unknowns.record("s1", &sender, now), "first: warn");
        assert!(unknowns.recent("s1", &sender, now + Duration::from_secs(1)));
        assert!(!unknowns.recent("s2", &sender, now), "per standby");
        assert!(
            !unknowns.recent("s1", &sender, now + UNKNOWN_KEPT),
            "looked up again"
        );
        assert!(
            !unknowns.record("s1", &sender, now + UNKNOWN_KEPT),
            "warned already"
        );
        unknowns.forget("s1");
        assert!(
            unknowns.record("s1", &sender, now),
            "told again after a change"
        );
    }
}
