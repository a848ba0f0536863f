//! How soon to try again after a failure, and when to say so.
//!
//! Failures come in two paces. A fast one costs the node nothing to retry and clears by
//! itself: nothing listens on the port (a restart), the server is starting up or shutting
//! down (refused before authentication), the session broke. A standby that restarted is cold,
//! so it is tried again within a second. A slow one needs someone to act, and retrying it
//! costs the node something: a wrong password, a pg_hba.conf refusal, a certificate that
//! does not verify, a missing extension, an unknown database, a missing privilege. Each
//! attempt is a failed login in the server's log, and with LDAP or PAM authentication it
//! counts toward locking the service account; so it backs off, doubling with jitter, up to
//! `max_backoff`, and from there waits exactly `max_backoff` (pgbouncer's
//! server_login_retry, 15 s, waits for the same reason). The jitter of the ramp is what keeps
//! several agents apart; at the cap a common period keeps the distance the ramp made.
//!
//! The pace comes from the SQLSTATE where the server sent one, never from its message text.
//!
//! Logging goes by episode: a run of failures from the first one to the next success. The
//! first failure of each kind in an episode is told (WARN, with when it retries); later ones
//! of that kind only at debug level; the end of the episode is one INFO line. A kind is the
//! stage, the side and the SQLSTATE or error variant, so a message that names a changing
//! number (a PID, an attempt, a byte count) is still one kind.

use std::fmt;
use std::time::{Duration, Instant};

use crate::backoff::Backoff;
use crate::config::format_duration;
use crate::metrics::Stage;
use crate::node::{NodeError, Side};
use crate::sync::CycleError;

/// How soon a failure is worth trying again. Ordered: `Fast` < `Slow`, so that of several
/// failures that could clear, the soonest one decides (`min`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pace {
    /// Within the reconnect ceiling (or the interval): it clears by itself, soon.
    Fast,
    /// Exponential backoff with jitter up to max_backoff, then every max_backoff.
    Slow,
}

/// The pace of a server error's SQLSTATE.
pub fn sqlstate_pace(code: &str) -> Pace {
    match code {
        // cannot_connect_now: starting up, shutting down, not yet consistent. The postmaster
        // refuses before authentication, so an attempt costs no login; the server is on its
        // way. ("hot standby mode is disabled" shares the code: a configuration, but its
        // attempts cost no login either.)
        "57P03" => Pace::Fast,
        // admin_shutdown, crash_shutdown, database_dropped (a recovery conflict),
        // idle_session_timeout: the session ended; the server restarts or a new session is
        // all it takes.
        "57P01" | "57P02" | "57P04" | "57P05" => Pace::Fast,
        // Recovery conflicts (serialization_failure, deadlock_detected): ordinary on a hot
        // standby. idle_in_transaction_session_timeout: the session ended, the next is fine.
        "40001" | "40P01" | "25P03" => Pace::Fast,
        // protocol_violation: the server and the agent disagree on the protocol; no retry
        // mends that.
        "08P01" => Pace::Slow,
        // connection_exception: the connection failed or broke.
        code if code.starts_with("08") => Pace::Fast,
        // invalid_authorization_specification (28000: pg_hba.conf refused, or no such role)
        // and invalid_password (28P01): each retry is a failed login.
        code if code.starts_with("28") => Pace::Slow,
        // invalid_catalog_name (3D000: no such database) and insufficient_privilege (42501):
        // nothing changes until someone acts.
        "3D000" | "42501" => Pace::Slow,
        // insufficient_resources (53300 too_many_connections, 53100 disk_full, 53200
        // out_of_memory): it may clear, but the server is overloaded and a quick retry adds
        // a backend (and, for the reserved slots and per-role limits, a login) to its load.
        // The first steps of the ramp are short anyway, so a brief peak costs little.
        code if code.starts_with("53") => Pace::Slow,
        // The rest (a statement timeout, a missing function of an old extension, an internal
        // error, a disk error) are faults of the server or the agent that do not clear in a
        // second; they backed off to max_backoff before too.
        _ => Pace::Slow,
    }
}

/// The pace of a tokio-postgres error: by SQLSTATE when the server sent one; a closed
/// connection or a socket error is a broken connection (fast); the client's own refusals
/// (invalid configuration such as a missing password, an authentication exchange that
/// failed, TLS, a message out of protocol) are slow.
fn client_pace(error: &tokio_postgres::Error) -> Pace {
    if let Some(db) = error.as_db_error() {
        return sqlstate_pace(db.code().code());
    }
    let io = std::error::Error::source(error).is_some_and(|s| s.is::<std::io::Error>());
    if error.is_closed() || io {
        Pace::Fast
    } else {
        Pace::Slow
    }
}

/// The pace of a node error.
pub fn node_pace(error: &NodeError) -> Pace {
    match error {
        NodeError::Connect { error, .. } | NodeError::Query { error, .. } => client_pace(error),
        // Refused, unreachable, a name that does not resolve (yet): no server process saw it.
        NodeError::Socket { .. } => Pace::Fast,
        // A silent host (packets dropped: down, or a firewall) or a node that stopped
        // answering: each attempt waits out the whole timeout anyway.
        NodeError::ConnectTimeout { .. } | NodeError::QueryTimeout { .. } => Pace::Slow,
        // Certificates and TLS settings, the extension missing or its library too old, an
        // answer the agent cannot use: someone has to act.
        NodeError::Tls { .. }
        | NodeError::ExtensionMissing { .. }
        | NodeError::LibraryOlderThanCatalog { .. }
        | NodeError::ExtensionTooOld { .. }
        | NodeError::Unexpected { .. } => Pace::Slow,
        // sslmode=prefer or allow tried two ways: if either may clear soon, so may the node.
        NodeError::Retried { first, then, .. } => node_pace(first).min(node_pace(then)),
        // Slow only when every host failed slowly: a host that is down, starting, or of the
        // other role right now (a failover) may be the one any second.
        NodeError::NoMatch { failures, .. } => all_slow(failures.iter().map(node_pace)),
        // No failures: never retried as one.
        NodeError::Disabled { .. } | NodeError::Cancelled => Pace::Fast,
        #[cfg(test)]
        NodeError::Simulated { .. } => Pace::Fast,
    }
}

/// The pace of a cycle's failure.
pub fn cycle_pace(error: &CycleError) -> Pace {
    match error {
        CycleError::Node { error, .. } => node_pace(error),
        // Another system, another primary's WAL: a misconfiguration or a standby not yet
        // following the new primary; it backed off to max_backoff before too.
        CycleError::Safety(_) => Pace::Slow,
        // A failover under way: the next attempt looks for the new primary or standby.
        CycleError::RoleChanged { .. } => Pace::Fast,
        // The primary's list does not decode: retrying at once would get the same.
        CycleError::Decode(_) => Pace::Slow,
        // Patroni unreachable or without a leader: a failover, usually.
        CycleError::Topology(_) => Pace::Fast,
        // Every standby failed: slow only if each did slowly.
        CycleError::Standbys { each, .. } => all_slow(each.iter().map(cycle_pace)),
        CycleError::Disabled { .. } | CycleError::StandingBy { .. } | CycleError::Cancelled => {
            Pace::Fast
        }
    }
}

/// Slow when there are paces and each is slow; fast otherwise (nothing failed slowly, or
/// something may clear soon).
fn all_slow(mut paces: impl Iterator<Item = Pace>) -> Pace {
    let mut any = false;
    let slow = paces.all(|pace| {
        any = true;
        pace == Pace::Slow
    });
    if any && slow {
        Pace::Slow
    } else {
        Pace::Fast
    }
}

/// The wait before the next attempt after a failure of `pace`, at most `cap`; advances
/// `backoff`. A slow failure waits exactly `cap` once the doubling has reached it, so that
/// there is at most one attempt per `cap` from then on.
pub fn next_delay(backoff: &mut Backoff, pace: Pace, cap: Duration) -> Duration {
    let at_cap = backoff.ceiling() >= cap;
    let drawn = backoff.next_delay().min(cap);
    match pace {
        Pace::Slow if at_cap => cap,
        _ => drawn,
    }
}

/// How the log says when the next attempt comes: "in 250ms", and for a slow failure still
/// below its cap, that the attempts grow rarer.
pub fn when(pace: Pace, delay: Duration, cap: Duration) -> String {
    let said = format_duration(Duration::from_millis(delay.as_millis() as u64));
    match pace {
        Pace::Slow if delay < cap => {
            format!(
                "{said}, then less and less often, up to every {}",
                format_duration(cap)
            )
        }
        _ => said,
    }
}

/// What failed, for telling a new failure from a repeated one: the stage, the side, and the
/// SQLSTATE or the error's variant. Never the message text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kind {
    stage: &'static str,
    side: &'static str,
    cause: String,
}

impl Kind {
    pub fn new(stage: Option<Stage>, side: Option<Side>, cause: impl Into<String>) -> Self {
        Kind {
            stage: stage.map(Stage::as_str).unwrap_or(""),
            side: side.map(Side::as_str).unwrap_or(""),
            cause: cause.into(),
        }
    }

    /// A note that is no fault (a host not in recovery): its fixed text is its kind.
    pub fn note(text: impl Into<String>) -> Self {
        Kind::new(None, None, text)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.stage, self.side, self.cause)
    }
}

/// The cause part of a node error's kind.
fn node_cause(error: &NodeError) -> String {
    let client = |error: &tokio_postgres::Error| match error.code() {
        Some(code) => code.code().to_string(),
        // tokio-postgres' words for its error kind ("connection closed", "invalid
        // configuration"): fixed, its cause is not part of them.
        None => error.to_string(),
    };
    match error {
        NodeError::Connect { error, .. } => client(error),
        NodeError::Query { what, error, .. } => format!("{what} {}", client(error)),
        NodeError::Socket { error, .. } => format!("socket {:?}", error.kind()),
        NodeError::Tls { .. } => "tls".into(),
        NodeError::Retried { first, then, .. } => {
            format!("{} then {}", node_cause(first), node_cause(then))
        }
        NodeError::ConnectTimeout { .. } => "connect timeout".into(),
        NodeError::ExtensionMissing { .. } => "extension missing".into(),
        NodeError::Disabled { .. } => "disabled".into(),
        NodeError::LibraryOlderThanCatalog { .. } => "library older than catalog".into(),
        NodeError::ExtensionTooOld { .. } => "extension too old".into(),
        NodeError::QueryTimeout { what, .. } => format!("{what} timeout"),
        NodeError::Unexpected { what, .. } => format!("{what} unexpected"),
        NodeError::NoMatch { failures, .. } if failures.is_empty() => "no match".into(),
        NodeError::NoMatch { failures, .. } => {
            let causes: Vec<String> = failures.iter().map(node_cause).collect();
            format!("no match: {}", causes.join(", "))
        }
        NodeError::Cancelled => "cancelled".into(),
        #[cfg(test)]
        NodeError::Simulated { class, .. } => format!("simulated {class:?}"),
    }
}

/// The kind of a cycle's failure.
pub fn cycle_kind(error: &CycleError) -> Kind {
    let stage = error.stage();
    match error {
        CycleError::Node { side, error, .. } => Kind::new(stage, Some(*side), node_cause(error)),
        CycleError::Safety(_) => Kind::new(stage, None, "safety"),
        CycleError::RoleChanged { side, .. } => Kind::new(stage, Some(*side), "role changed"),
        CycleError::Decode(_) => Kind::new(stage, Some(Side::Primary), "decode"),
        CycleError::Topology(_) => Kind::new(stage, None, "topology"),
        CycleError::Standbys { each, .. } => {
            let causes: Vec<String> = each.iter().map(|e| cycle_kind(e).to_string()).collect();
            Kind::new(stage, Some(Side::Standby), causes.join(", "))
        }
        CycleError::Disabled { side, .. } => Kind::new(stage, Some(*side), "disabled"),
        CycleError::StandingBy { .. } => Kind::new(stage, None, "standing by"),
        CycleError::Cancelled => Kind::new(stage, None, "cancelled"),
    }
}

/// A bound on the kinds remembered per episode: past it, a new kind is told no more (a
/// stream of ever new kinds would be a bug, and must not grow memory).
const MAX_KINDS: usize = 32;

/// A run of failures, from the first to the next success.
#[derive(Debug, Default)]
pub struct Episode {
    /// The kinds told so far in this episode.
    told: Vec<Kind>,
    failures: u32,
    since: Option<Instant>,
}

/// An episode that ended: what its INFO line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    pub failures: u32,
    pub lasted: Duration,
}

impl fmt::Display for Ended {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lasted = format_duration(Duration::from_secs(self.lasted.as_secs()));
        match self.failures {
            1 => write!(f, "1 failed attempt in {lasted}"),
            n => write!(f, "{n} failed attempts in {lasted}"),
        }
    }
}

impl Episode {
    /// Counts a failure of `kind` at `now`. True when it is to be told (WARN): the first of
    /// its kind in this episode; false for a repeat (debug level only).
    pub fn failed(&mut self, kind: Kind, now: Instant) -> bool {
        self.failures = self.failures.saturating_add(1);
        self.since.get_or_insert(now);
        if self.told.contains(&kind) || self.told.len() >= MAX_KINDS {
            return false;
        }
        self.told.push(kind);
        true
    }

    /// A success at `now`: the episode ends. Its summary, if one was under way.
    pub fn end(&mut self, now: Instant) -> Option<Ended> {
        let since = self.since.take()?;
        let ended = Ended {
            failures: self.failures,
            lasted: now.saturating_duration_since(since),
        };
        *self = Episode::default();
        Some(ended)
    }

    /// A new configuration: the episode goes on, but each kind is told once more (the
    /// operator who reloaded wants to know whether it still fails).
    pub fn retell(&mut self) {
        self.told.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backoff::INITIAL;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn sqlstates_have_a_pace() {
        for code in [
            "57P03", "57P01", "57P02", "57P04", "57P05", "08006", "08001", "08003", "08000",
            "08004", "40001", "40P01", "25P03",
        ] {
            assert_eq!(sqlstate_pace(code), Pace::Fast, "{code}");
        }
        for code in [
            "28P01", "28000", "3D000", "42501", "53300", "53100", "53200", "08P01", "42883",
            "57014", "XX000", "55000", "0A000",
        ] {
            assert_eq!(sqlstate_pace(code), Pace::Slow, "{code}");
        }
    }

    fn socket(kind: std::io::ErrorKind) -> NodeError {
        NodeError::Socket {
            host: "h:5432".into(),
            error: kind.into(),
        }
    }

    fn tls() -> NodeError {
        NodeError::Tls {
            host: "h:5432".into(),
            reason: "certificate verify failed: certificate has expired".into(),
        }
    }

    #[test]
    fn node_errors_have_a_pace() {
        use std::io::ErrorKind::*;
        for kind in [
            ConnectionRefused,
            HostUnreachable,
            NetworkUnreachable,
            Other,
        ] {
            assert_eq!(node_pace(&socket(kind)), Pace::Fast, "{kind:?}");
        }
        let timeout = NodeError::ConnectTimeout {
            host: "h:5432".into(),
            after: Duration::from_secs(10),
        };
        let missing = NodeError::ExtensionMissing {
            host: "h:5432".into(),
            database: "postgres".into(),
        };
        let old = NodeError::LibraryOlderThanCatalog {
            host: "h:5432".into(),
            library: None,
            catalog: "0.7.0".into(),
        };
        let silent = NodeError::QueryTimeout {
            host: "h:5432".into(),
            what: "ccm_prewarm()",
            after: Duration::from_secs(35),
        };
        for slow in [&timeout, &tls(), &missing, &old, &silent] {
            assert_eq!(node_pace(slow), Pace::Slow, "{slow}");
        }
        // Two ways tried: either could clear soon.
        let retried = |first, then| NodeError::Retried {
            first: Box::new(first),
            then_how: "without TLS (sslmode=prefer)",
            then: Box::new(then),
        };
        assert_eq!(node_pace(&retried(tls(), timeout)), Pace::Slow);
        assert_eq!(
            node_pace(&retried(tls(), socket(ConnectionRefused))),
            Pace::Fast
        );
    }

    fn no_match(failures: Vec<NodeError>) -> NodeError {
        NodeError::NoMatch {
            side: Side::Primary,
            tried: "...".into(),
            failures,
        }
    }

    #[test]
    fn hosts_of_a_multi_host_string_are_slow_only_when_each_is() {
        use std::io::ErrorKind::ConnectionRefused;
        assert_eq!(node_pace(&no_match(vec![tls(), tls()])), Pace::Slow);
        assert_eq!(
            node_pace(&no_match(vec![tls(), socket(ConnectionRefused)])),
            Pace::Fast
        );
        // A host of the other role (no failure recorded): a failover may be under way.
        assert_eq!(node_pace(&no_match(Vec::new())), Pace::Fast);
    }

    #[test]
    fn cycle_errors_have_a_pace() {
        use std::io::ErrorKind::ConnectionRefused;
        let node = |error| CycleError::Node {
            stage: Stage::Connect,
            side: Side::Standby,
            error,
        };
        assert_eq!(cycle_pace(&node(tls())), Pace::Slow);
        assert_eq!(cycle_pace(&node(socket(ConnectionRefused))), Pace::Fast);
        assert_eq!(cycle_pace(&CycleError::Safety("x".into())), Pace::Slow);
        assert_eq!(cycle_pace(&CycleError::Decode("x".into())), Pace::Slow);
        assert_eq!(cycle_pace(&CycleError::Topology("x".into())), Pace::Fast);
        let role = CycleError::RoleChanged {
            side: Side::Primary,
            message: "x".into(),
        };
        assert_eq!(cycle_pace(&role), Pace::Fast);
        let standbys = |each| CycleError::Standbys {
            stage: Stage::Connect,
            message: "x".into(),
            each,
        };
        assert_eq!(
            cycle_pace(&standbys(vec![node(tls()), node(tls())])),
            Pace::Slow
        );
        assert_eq!(
            cycle_pace(&standbys(vec![
                node(tls()),
                node(socket(ConnectionRefused))
            ])),
            Pace::Fast
        );
    }

    /// A server that reads the startup message and answers with a FATAL error of `code`,
    /// or hangs up when `code` is None.
    async fn refusing_server(code: Option<&'static str>, message: String) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let mut len = [0u8; 4];
            if socket.read_exact(&mut len).await.is_err() {
                return;
            }
            let mut rest = vec![0u8; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
            if socket.read_exact(&mut rest).await.is_err() {
                return;
            }
            let Some(code) = code else { return };
            let mut body = Vec::new();
            for (field, value) in [(b'S', "FATAL"), (b'V', "FATAL"), (b'C', code)] {
                body.push(field);
                body.extend_from_slice(value.as_bytes());
                body.push(0);
            }
            body.push(b'M');
            body.extend_from_slice(message.as_bytes());
            body.extend_from_slice(&[0, 0]);
            let mut reply = vec![b'E'];
            reply.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
            reply.extend_from_slice(&body);
            let _ = socket.write_all(&reply).await;
        });
        port
    }

    /// The error of connecting to a server that answers with `code` and `message`.
    async fn refused(code: Option<&'static str>, message: &str) -> NodeError {
        let port = refusing_server(code, message.to_string()).await;
        crate::node::tests::connect_error(port, "disable").await
    }

    fn connect_failure(error: NodeError) -> CycleError {
        CycleError::Node {
            stage: Stage::Connect,
            side: Side::Standby,
            error,
        }
    }

    #[tokio::test]
    async fn a_refused_login_is_slow_and_one_kind_whatever_its_message() {
        let wrong = refused(
            Some("28P01"),
            "password authentication failed for user \"u\"",
        )
        .await;
        assert!(
            wrong.to_string().contains("password authentication failed"),
            "{wrong}"
        );
        assert_eq!(node_pace(&wrong), Pace::Slow);
        let hba = refused(Some("28000"), "no pg_hba.conf entry for host \"127.0.0.1\"").await;
        assert_eq!(node_pace(&hba), Pace::Slow);
        let no_db = refused(Some("3D000"), "database \"d\" does not exist").await;
        assert_eq!(node_pace(&no_db), Pace::Slow);

        // A message that varies (here a number) is still the same kind; another SQLSTATE
        // or another side is not.
        let first = cycle_kind(&connect_failure(
            refused(Some("28P01"), "attempt 1 refused").await,
        ));
        let again = cycle_kind(&connect_failure(
            refused(Some("28P01"), "attempt 2 refused").await,
        ));
        assert_eq!(first, again);
        assert_eq!(first.to_string(), "connect/standby/28P01");
        assert_ne!(first, cycle_kind(&connect_failure(hba)));
        let primary = CycleError::Node {
            stage: Stage::Connect,
            side: Side::Primary,
            error: refused(Some("28P01"), "attempt 1 refused").await,
        };
        assert_ne!(first, cycle_kind(&primary));
    }

    #[tokio::test]
    async fn a_server_starting_up_or_hanging_up_is_fast() {
        let starting = refused(Some("57P03"), "the database system is starting up").await;
        assert_eq!(node_pace(&starting), Pace::Fast);
        let shutting = refused(Some("57P01"), "terminating connection").await;
        assert_eq!(node_pace(&shutting), Pace::Fast);
        let hung_up = refused(None, "").await;
        assert!(matches!(hung_up, NodeError::Connect { .. }), "{hung_up}");
        assert_eq!(node_pace(&hung_up), Pace::Fast, "{hung_up}");
    }

    fn seeded(max: Duration) -> Backoff {
        Backoff::with_rng(INITIAL, max, fastrand::Rng::with_seed(11))
    }

    #[test]
    fn a_slow_failure_ramps_up_then_waits_exactly_max_backoff() {
        let max = Duration::from_secs(8);
        let mut backoff = seeded(max);
        let delays: Vec<Duration> = (0..12)
            .map(|_| next_delay(&mut backoff, Pace::Slow, max))
            .collect();
        // 250 ms, 500 ms, 1 s, 2 s, 4 s (each drawn from [d/2, d]), then 8 s on the dot.
        for (delay, ceiling_ms) in delays.iter().zip([250, 500, 1000, 2000, 4000]) {
            let ceiling = Duration::from_millis(ceiling_ms);
            assert!(*delay <= ceiling && *delay >= ceiling / 2, "{delays:?}");
        }
        assert!(delays[5..].iter().all(|d| *d == max), "{delays:?}");
        // Over a minute: the first few of the ramp, then one per max_backoff.
        let mut backoff = seeded(max);
        let window = Duration::from_secs(60);
        let (mut at, mut attempts) = (Duration::ZERO, 0);
        while at < window {
            attempts += 1;
            at += next_delay(&mut backoff, Pace::Slow, max);
        }
        assert!(
            attempts <= 6 + 60 / 8 + 1,
            "{attempts} attempts in {window:?}"
        );
    }

    #[test]
    fn a_fast_failure_is_tried_again_within_its_cap() {
        let ceiling = Duration::from_secs(1);
        let mut backoff = seeded(Duration::from_secs(30));
        for _ in 0..50 {
            assert!(next_delay(&mut backoff, Pace::Fast, ceiling) <= ceiling);
        }
        // A slow failure after many fast ones waits its full cap at once.
        assert_eq!(
            next_delay(&mut backoff, Pace::Slow, Duration::from_secs(30)),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn the_log_says_when_attempts_grow_rarer() {
        let max = Duration::from_secs(8);
        assert_eq!(
            when(Pace::Slow, Duration::from_millis(187), max),
            "187ms, then less and less often, up to every 8s"
        );
        assert_eq!(when(Pace::Slow, max, max), "8s");
        assert_eq!(
            when(
                Pace::Fast,
                Duration::from_millis(1000),
                Duration::from_secs(1)
            ),
            "1s"
        );
    }

    fn kind(cause: &str) -> Kind {
        Kind::new(Some(Stage::Connect), Some(Side::Standby), cause)
    }

    #[test]
    fn an_episode_tells_each_kind_once_and_its_end() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut episode = Episode::default();
        assert_eq!(episode.end(t0), None, "no episode, no INFO line");
        let sequence = [
            "socket ConnectionRefused",
            "socket ConnectionRefused",
            "57P03",
            "socket ConnectionRefused",
            "57P03",
            "28P01",
            "28P01",
            "28P01",
        ];
        let told: Vec<bool> = sequence
            .iter()
            .enumerate()
            .map(|(i, cause)| episode.failed(kind(cause), at(i as u64)))
            .collect();
        assert_eq!(
            told,
            [true, false, true, false, false, true, false, false],
            "each kind once, alternating kinds included"
        );
        let ended = episode.end(at(20)).unwrap();
        assert_eq!(
            ended,
            Ended {
                failures: 8,
                lasted: Duration::from_secs(20)
            }
        );
        assert_eq!(ended.to_string(), "8 failed attempts in 20s");
        assert_eq!(episode.end(at(21)), None, "one INFO line per episode");
        // A new episode tells its kinds again.
        assert!(episode.failed(kind("28P01"), at(30)));
        assert!(!episode.failed(kind("28P01"), at(31)));
        // A reload: told once more, and the episode goes on.
        episode.retell();
        assert!(episode.failed(kind("28P01"), at(32)));
        assert_eq!(episode.end(at(33)).unwrap().failures, 3);
    }

    #[test]
    fn an_episode_remembers_a_bounded_number_of_kinds() {
        let now = Instant::now();
        let mut episode = Episode::default();
        let told = (0..100)
            .filter(|i| episode.failed(kind(&format!("cause {i}")), now))
            .count();
        assert_eq!(told, MAX_KINDS);
        assert_eq!(episode.end(now).unwrap().failures, 100);
    }

    #[test]
    fn a_wrong_password_is_told_once_and_tried_once_per_max_backoff() {
        // What the run loop does with a minute of one failure: which attempts log, and how
        // long each waits.
        let max = Duration::from_secs(8);
        let mut backoff = seeded(max);
        let mut episode = Episode::default();
        let start = Instant::now();
        let mut at = Duration::ZERO;
        let mut attempts = Vec::new();
        while at < Duration::from_secs(60) {
            let told = episode.failed(kind("28P01"), start + at);
            let delay = next_delay(&mut backoff, Pace::Slow, max);
            attempts.push((at, told, delay));
            at += delay;
        }
        assert_eq!(attempts.iter().filter(|(_, told, _)| *told).count(), 1);
        assert!(attempts[0].1, "the first failure is told");
        assert!(attempts.iter().all(|(_, _, d)| *d <= max));
        // After the ramp, the attempts are max_backoff apart.
        let late: Vec<_> = attempts.iter().filter(|(t, _, _)| *t >= max).collect();
        assert!(late.windows(2).all(|w| w[1].0 - w[0].0 == max), "{late:?}");
        let ended = episode.end(start + at).unwrap();
        assert_eq!(ended.failures as usize, attempts.len());
    }
}
