//! One active agent per cluster: the `run` daemons elect one through a session-level advisory
//! lock on the primary.
//!
//! Why: two agents on one cluster thrash each other. Each change-feed call with another
//! subscriber resets the node's feed (feed.rs), so every node re-sweeps its whole cache and
//! every standby is prewarmed twice, every cycle. A sidecar per Patroni member, a blue/green
//! upgrade or a forgotten test agent is enough, so the README's "one agent per cluster" is
//! enforced here rather than asked for.
//!
//! Why an advisory lock on the primary: every agent of a cluster already keeps a session with
//! the primary, and PostgreSQL releases a session-level advisory lock by itself when that
//! session ends: the agent exits or is killed, its host drops off the network (noticed by the
//! TCP keepalives this session sets, [`SQL_TRY_LOCK`]), the primary restarts or is
//! replaced. No lease to renew, no clock, no extra service: the agent that holds the lock warms,
//! the others stand by on an open primary session, call nothing of pg_ccm's feed, filter or
//! prewarm on any node (so they reset no feed) and try again every interval. A failover moves
//! the election with the primary: the old primary's sessions are gone, and the agents compete
//! on the new one. The lock is taken with `pg_try_advisory_lock` (never waits, session-level,
//! so no transaction holds it) and is never a relation lock: nothing of the primary's own work
//! can wait on it.
//!
//! Its limits:
//! - An advisory lock belongs to one database: agents that connect to different databases of
//!   one primary do not see each other. Point every agent at the database pg_ccm is installed in.
//! - A transaction-pooling proxy (PgBouncer `pool_mode = transaction`) between the agent and the
//!   primary breaks session locks: connect directly, or through session pooling.
//! - A partitioned old primary that still accepts the old agent's session keeps its own lock:
//!   two agents can be active on two primaries until it is fenced (alert
//!   CcmSeveralActiveAgents).
//! - An agent whose host is cut off keeps the lock until the primary's keepalives give up on
//!   its session (about 25 s, [`SQL_TRY_LOCK`]); an agent that exits or is killed frees
//!   it at once, as does one whose primary session ends.
//! - The lock says which agent may warm, not that it can: an agent that hangs (its loop stuck,
//!   the process stopped) or reaches the primary but no standby keeps it while its session
//!   lives. systemd's watchdog restarts a hung loop; the others show up in its /readyz and
//!   the CcmAgentNotReady alert.
//! - `sync --once` does not take part: it uses the filter exchange, which resets no feed, and
//!   only says in its output which agent is active.

use std::fmt;

use serde::Serialize;
use tracing::{debug, info};

use crate::metrics::Metrics;
use crate::node::NodeError;
use crate::nodeapi::NodeApi;

/// pg_ccm's advisory lock key: "pg_ccm" and 0x0001 in ASCII, 8099547335323615233. pg_locks
/// shows it as `locktype = 'advisory'`, `classid` 1885822819 (its high 32 bits), `objid`
/// 1668087809 (its low 32 bits), `objsubid` 1 (a bigint key).
pub const LOCK_KEY: i64 = 0x7067_5f63_636d_0001;

/// What pg_locks shows of [`LOCK_KEY`] (README, "One agent per cluster").
pub const LOCK_CLASSID: u32 = (LOCK_KEY >> 32) as u32;
pub const LOCK_OBJID: u32 = LOCK_KEY as u32;

/// The session keepalives set with each try: the primary ends the session of an agent whose
/// host stopped answering after 10 s idle and 3 probes 5 s apart, or 25 s of unacknowledged
/// data, and the lock goes with it. Each is a user-settable GUC; over a Unix socket they do
/// nothing, which is right (no network to lose).
macro_rules! keepalive_settings {
    () => {
        "set_config('tcp_keepalives_idle', '10', false), \
         set_config('tcp_keepalives_interval', '5', false), \
         set_config('tcp_keepalives_count', '3', false), \
         set_config('tcp_user_timeout', '25000', false)"
    };
}
/// The try, one statement: the session-level lock (never waits, outlives the statement's
/// implicit transaction) and the keepalives that bound how long a lost agent keeps it.
pub const SQL_TRY_LOCK: &str = concat!(
    "SELECT pg_try_advisory_lock($1::int8), ",
    keepalive_settings!()
);

/// Who holds the lock in this session's database: pg_locks joined with pg_stat_activity.
/// application_name and client_addr are NULL for a role that may not see that session.
pub const SQL_HOLDER: &str =
    "SELECT l.pid, a.application_name, host(a.client_addr), a.client_port \
     FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
     WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
       AND l.classid::int8 = ($1::int8 >> 32) & 4294967295 \
       AND l.objid::int8 = $1::int8 & 4294967295 \
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
     ORDER BY l.pid LIMIT 1";

/// A standing-by agent looks the holder up when it starts standing by, then after this many
/// tries at most (a holder that changed is logged; /readyz and the metrics name it).
pub const HOLDER_RECHECK_TRIES: u32 = 5;

/// The primary session that holds the lock, as pg_locks and pg_stat_activity show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Holder {
    pub pid: i32,
    pub application_name: Option<String>,
    pub client_addr: Option<String>,
    pub client_port: Option<i32>,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {}", self.pid)?;
        if let Some(name) = self.application_name.as_deref().filter(|n| !n.is_empty()) {
            write!(f, ", application_name {name}")?;
        }
        match (&self.client_addr, self.client_port) {
            (Some(addr), Some(port)) if port > 0 => write!(f, ", client {addr}:{port}"),
            (Some(addr), _) => write!(f, ", client {addr}"),
            // -1: a Unix socket; NULL too when the role may not see the session.
            (None, Some(-1)) => write!(f, ", local socket"),
            (None, _) => Ok(()),
        }
    }
}

/// How a holder is named when it could not be looked up.
pub fn describe(holder: Option<&Holder>) -> String {
    match holder {
        Some(h) => h.to_string(),
        None => "holder unknown".to_string(),
    }
}

/// Where this agent stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// No try on the current primary session yet (none, or a new one).
    Contending,
    /// Holds the lock on the current primary session: warms.
    Active,
    /// Another session holds the lock: warms nothing, tries again each interval.
    StandingBy,
}

/// A change to log, once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Took the lock, without standing by before.
    Active,
    /// Took the lock after standing by: the holder is gone.
    TookOver,
    /// Started standing by.
    StandingBy(Option<Holder>),
    /// While standing by, another session holds the lock now.
    HolderChanged(Holder),
    /// The primary session that held the lock ended, and the lock with it.
    LockLost,
}

impl Event {
    /// Logs this change; `primary` names the primary's host.
    pub fn log(&self, primary: &str) {
        match self {
            Event::Active => info!(
                "holding the ccm-agent lock on the primary {primary} (advisory lock {LOCK_KEY}: \
                 pg_locks classid {LOCK_CLASSID}, objid {LOCK_OBJID}); this agent warms the cluster"
            ),
            Event::TookOver => info!(
                "took the ccm-agent lock on the primary {primary}: the agent that held it is gone; \
                 this agent warms the cluster now"
            ),
            Event::StandingBy(holder) => info!(
                holder = %describe(holder.as_ref()),
                "another ccm-agent holds the ccm-agent lock on the primary {primary} ({}); \
                 standing by (warming nothing, trying again every interval)",
                describe(holder.as_ref())
            ),
            Event::HolderChanged(holder) => info!(
                holder = %holder,
                "the ccm-agent lock on the primary {primary} is held by another agent now ({holder}); \
                 still standing by"
            ),
            Event::LockLost => info!(
                "the session with the primary {primary} ended and the ccm-agent lock with it; \
                 competing for it again on the next session"
            ),
        }
    }
}

/// The election's state machine: pure, so that its transitions are tested without a server.
#[derive(Debug, Clone)]
pub struct Election {
    role: Role,
    /// The holder at the last lookup (None: unknown, or released since).
    holder: Option<Holder>,
    /// Tries since the last lookup of the holder.
    tries_since_lookup: u32,
    /// The holder named by the last "standing by" or "held by another agent now" of this
    /// standing-by episode; None until one is logged. Survives a new primary session, so an
    /// agent that reconnects and stands by behind the same holder logs nothing new.
    logged: Option<Option<Holder>>,
}

impl Default for Election {
    fn default() -> Self {
        Election {
            role: Role::Contending,
            holder: None,
            tries_since_lookup: 0,
            logged: None,
        }
    }
}

impl Election {
    pub fn is_active(&self) -> bool {
        self.role == Role::Active
    }

    /// The holder as last looked up, for /readyz and the cycle's error.
    pub fn holder(&self) -> Option<&Holder> {
        self.holder.as_ref()
    }

    /// Whether a lost try should look the holder up: when the agent starts standing by, and
    /// every [`HOLDER_RECHECK_TRIES`] tries after.
    pub fn wants_holder(&self) -> bool {
        self.role != Role::StandingBy || self.tries_since_lookup + 1 >= HOLDER_RECHECK_TRIES
    }

    /// This session took the lock.
    pub fn won(&mut self) -> Option<Event> {
        if self.role == Role::Active {
            return None;
        }
        let event = match self.logged.take() {
            Some(_) => Event::TookOver,
            None => Event::Active,
        };
        self.role = Role::Active;
        self.holder = None;
        self.tries_since_lookup = 0;
        Some(event)
    }

    /// Another session holds the lock; `looked_up` is the holder query's answer, when it was
    /// asked (`wants_holder`) and answered.
    pub fn lost(&mut self, looked_up: Option<Option<Holder>>) -> Option<Event> {
        self.role = Role::StandingBy;
        match looked_up {
            Some(found) => {
                self.tries_since_lookup = 0;
                self.holder = found;
            }
            None => self.tries_since_lookup += 1,
        }
        match &self.logged {
            None => {
                self.logged = Some(self.holder.clone());
                Some(Event::StandingBy(self.holder.clone()))
            }
            Some(named) => match &self.holder {
                Some(holder) if named.as_ref() != Some(holder) => {
                    self.logged = Some(Some(holder.clone()));
                    Some(Event::HolderChanged(holder.clone()))
                }
                _ => None,
            },
        }
    }

    /// The primary session ended (failover, network, reconfiguration): a lock it held went
    /// with it, and the next session competes again.
    pub fn session_lost(&mut self) -> Option<Event> {
        let was = std::mem::replace(&mut self.role, Role::Contending);
        self.tries_since_lookup = 0;
        (was == Role::Active).then_some(Event::LockLost)
    }

    /// What the metrics and /readyz show: the gauge, and the holder while standing by.
    pub fn publish(&self, metrics: &Metrics) {
        let standing_by = (self.role == Role::StandingBy).then(|| describe(self.holder.as_ref()));
        metrics.set_election(self.role == Role::Active, standing_by);
    }

    /// One round on the primary session: nothing while this agent holds the lock, else a
    /// try, a lookup of the holder when the try fails (when due; a failed lookup is only
    /// logged at debug level), the change logged once and published. Returns whether this
    /// agent is active.
    pub async fn contest<N: NodeApi>(
        &mut self,
        primary: &mut N,
        metrics: &Metrics,
    ) -> Result<bool, NodeError> {
        if self.is_active() {
            return Ok(true);
        }
        let won = primary.try_agent_lock().await?;
        let event = if won {
            self.won()
        } else {
            let looked_up = if self.wants_holder() {
                lookup(primary).await
            } else {
                None
            };
            self.lost(looked_up)
        };
        if let Some(event) = event {
            event.log(&primary.label());
        }
        self.publish(metrics);
        Ok(won)
    }
}

/// The holder on `primary`: Some(answer), or None when the query failed (logged at debug
/// level: the election does not depend on it).
pub async fn lookup<N: NodeApi>(primary: &mut N) -> Option<Option<Holder>> {
    match primary.agent_lock_holder().await {
        Ok(found) => Some(found),
        Err(error) => {
            debug!(%error, "looking up the ccm-agent lock's holder failed");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: i32) -> Holder {
        Holder {
            pid,
            application_name: Some("ccm-agent".into()),
            client_addr: Some("10.0.0.7".into()),
            client_port: Some(50432),
        }
    }

    #[test]
    fn the_key_is_what_pg_locks_shows() {
        assert_eq!(LOCK_KEY, 8_099_547_335_323_615_233);
        assert_eq!(LOCK_CLASSID, 1_885_822_819);
        assert_eq!(LOCK_OBJID, 1_668_087_809);
        assert_eq!(&LOCK_KEY.to_be_bytes()[..6], b"pg_ccm");
    }

    #[test]
    fn the_lock_is_session_level_and_never_waits() {
        assert!(SQL_TRY_LOCK.starts_with("SELECT pg_try_advisory_lock($1::int8)"));
        assert!(SQL_TRY_LOCK.contains("set_config('tcp_keepalives_idle', '10', false)"));
        assert!(SQL_TRY_LOCK.contains("set_config('tcp_user_timeout', '25000', false)"));
        for sql in [SQL_TRY_LOCK, SQL_HOLDER] {
            let lower = sql.to_lowercase();
            assert!(!lower.contains("xact"), "{sql}");
            assert!(!lower.contains("lock table"), "{sql}");
            assert!(!lower.contains("begin"), "{sql}");
        }
        assert!(SQL_HOLDER.contains("pg_stat_activity") && SQL_HOLDER.contains("l.granted"));
    }

    #[test]
    fn first_try_won_is_active_and_logged_once() {
        let mut e = Election::default();
        assert_eq!(e.role, Role::Contending);
        assert_eq!(e.won(), Some(Event::Active));
        assert!(e.is_active());
        assert_eq!(e.won(), None, "logged once");
    }

    #[test]
    fn standing_by_is_logged_once_with_the_holder() {
        let mut e = Election::default();
        assert!(
            e.wants_holder(),
            "the holder is looked up when standing by starts"
        );
        assert_eq!(
            e.lost(Some(Some(holder(7)))),
            Some(Event::StandingBy(Some(holder(7))))
        );
        assert_eq!(e.role, Role::StandingBy);
        assert!(!e.is_active());
        // The next tries: no lookup until HOLDER_RECHECK_TRIES, nothing logged.
        for _ in 1..HOLDER_RECHECK_TRIES {
            assert!(!e.wants_holder());
            assert_eq!(e.lost(None), None);
        }
        assert!(e.wants_holder(), "looked up again every few tries");
        assert_eq!(e.lost(Some(Some(holder(7)))), None, "the same holder");
        assert_eq!(e.holder(), Some(&holder(7)));
    }

    #[test]
    fn a_new_holder_is_logged_and_a_vanished_one_is_not() {
        let mut e = Election::default();
        e.lost(Some(Some(holder(7))));
        assert_eq!(
            e.lost(Some(None)),
            None,
            "released since: the next try tells"
        );
        assert_eq!(e.holder(), None);
        assert_eq!(
            e.lost(Some(Some(holder(8)))),
            Some(Event::HolderChanged(holder(8)))
        );
        assert_eq!(e.lost(Some(Some(holder(8)))), None);
    }

    #[test]
    fn an_unknown_holder_is_named_once_known() {
        let mut e = Election::default();
        assert_eq!(e.lost(None), Some(Event::StandingBy(None)));
        assert_eq!(
            e.lost(Some(Some(holder(9)))),
            Some(Event::HolderChanged(holder(9)))
        );
    }

    #[test]
    fn taking_over_after_standing_by() {
        let mut e = Election::default();
        e.lost(Some(Some(holder(7))));
        assert_eq!(e.won(), Some(Event::TookOver));
        assert!(e.is_active());
        assert_eq!(e.holder(), None);
        // Standing by again later is a new episode: logged again.
        e.session_lost();
        assert_eq!(
            e.lost(Some(Some(holder(7)))),
            Some(Event::StandingBy(Some(holder(7))))
        );
    }

    #[test]
    fn a_lost_session_loses_the_lock_and_competes_again() {
        let mut e = Election::default();
        e.won();
        assert_eq!(e.session_lost(), Some(Event::LockLost));
        assert_eq!(e.role, Role::Contending);
        assert!(e.wants_holder());
        assert_eq!(e.session_lost(), None, "nothing held: nothing lost");
        assert_eq!(e.won(), Some(Event::Active));
    }

    #[test]
    fn a_standby_that_reconnects_behind_the_same_holder_logs_nothing_new() {
        let mut e = Election::default();
        e.lost(Some(Some(holder(7))));
        assert_eq!(e.session_lost(), None);
        assert!(e.wants_holder(), "a new session looks the holder up");
        assert_eq!(e.lost(Some(Some(holder(7)))), None);
        assert_eq!(e.role, Role::StandingBy);
        assert_eq!(e.session_lost(), None);
        assert_eq!(
            e.lost(Some(Some(holder(3)))),
            Some(Event::HolderChanged(holder(3))),
            "a failover to a primary where another agent won"
        );
    }

    #[test]
    fn holders_are_named_with_what_is_known() {
        assert_eq!(
            holder(7).to_string(),
            "pid 7, application_name ccm-agent, client 10.0.0.7:50432"
        );
        let local = Holder {
            pid: 8,
            application_name: Some("ccm-agent".into()),
            client_addr: None,
            client_port: Some(-1),
        };
        assert_eq!(
            local.to_string(),
            "pid 8, application_name ccm-agent, local socket"
        );
        let hidden = Holder {
            pid: 9,
            application_name: None,
            client_addr: None,
            client_port: None,
        };
        assert_eq!(hidden.to_string(), "pid 9");
        assert_eq!(describe(None), "holder unknown");
    }

    #[test]
    fn the_metrics_show_the_role() {
        let metrics = Metrics::new();
        let mut e = Election::default();
        e.lost(Some(Some(holder(7))));
        e.publish(&metrics);
        let (ready, body) = metrics.readiness();
        assert!(!ready);
        let reason = body["reasons"][0].as_str().unwrap();
        assert!(
            reason.starts_with("standby: ") && reason.contains("pid 7"),
            "{body}"
        );
        assert!(metrics.render().contains("ccm_agent_active 0"));
        e.won();
        e.publish(&metrics);
        assert!(metrics.render().contains("ccm_agent_active 1"));
        assert_eq!(metrics.readiness().1["active"], true);
    }
}
