//! The sync cycle against in-memory nodes (fake.rs): what one standby's trouble does to the
//! others and to the next cycles. The same cycle code runs as in the agent; only the node
//! behind `NodeApi` is fake. Real servers are the integration tests' business.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::{Config, RawConfig};
use crate::fake::{self, FakeNode, Server};
use crate::metrics::Metrics;
use crate::report::CycleReport;
use crate::sync::Syncer;

type Node = Arc<std::sync::Mutex<Server>>;

/// Hot blocks 0..HOT on the primary.
const HOT: u32 = 200;

struct Cluster {
    syncer: Syncer<FakeNode>,
    metrics: Arc<Metrics>,
    primary: Node,
    standbys: Vec<Node>,
    ports: Vec<u16>,
}

/// A primary at port `base` with HOT hot blocks and `n` standbys at the next ports,
/// following it; the agent warms them in batches of 20 blocks.
fn cluster(base: u16, n: u16) -> Cluster {
    let primary = fake::server(
        base,
        Server {
            system_identifier: "7".into(),
            shared_buffers: 1000,
            timeline: 1,
            hot: (0..HOT).map(|b| (b, 5)).collect(),
            ..Default::default()
        },
    );
    let ports: Vec<u16> = (1..=n).map(|i| base + i).collect();
    let standbys = ports
        .iter()
        .map(|&port| {
            fake::server(
                port,
                Server {
                    in_recovery: true,
                    system_identifier: "7".into(),
                    shared_buffers: 1000,
                    timeline: 1,
                    sender: Some(("127.0.0.1".into(), base)),
                    ..Default::default()
                },
            )
        })
        .collect();
    let hosts = vec!["127.0.0.1"; ports.len()].join(",");
    let port_list = ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    // The primary string lists the standbys too, so that a promoted one is found.
    let cfg = Config::validate(RawConfig {
        primary: Some(format!(
            "host=127.0.0.1,{hosts} port={base},{port_list} user=u dbname=postgres"
        )),
        standby: Some(format!(
            "host={hosts} port={port_list} user=u dbname=postgres"
        )),
        interval: Some("200ms".into()),
        batch_blocks: Some(20),
        // A silent node's call ends after 1 s + 2 s (node.rs's call deadline).
        statement_timeout: Some("1s".into()),
        connect_timeout: Some("1s".into()),
        max_backoff: Some("1s".into()),
        // The pause after a pass that found nothing to read.
        os_cache_pause: Some("300ms".into()),
        ..Default::default()
    })
    .expect("a valid test configuration");
    let metrics = Arc::new(Metrics::new());
    let syncer = Syncer::new(Arc::new(cfg), metrics.clone(), CancellationToken::new());
    Cluster {
        syncer,
        metrics,
        primary,
        standbys,
        ports,
    }
}

impl Cluster {
    async fn cycle(&mut self) -> (CycleReport, Duration) {
        let started = Instant::now();
        let report = self.syncer.cycle(None).await.expect("a cycle");
        (report, started.elapsed())
    }

    /// Cycles every interval until every standby of `which` caches the primary's whole hot
    /// set; returns how many cycles that took (at most 10 s of them).
    async fn warm(&mut self, which: &[usize]) -> u32 {
        let started = Instant::now();
        let mut cycles = 0;
        while started.elapsed() < Duration::from_secs(10) {
            cycles += 1;
            let _ = self.syncer.cycle(None).await;
            if which.iter().all(|&i| self.holds_hot_set(i)) {
                return cycles;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("standbys {which:?} not warm after {cycles} cycles");
    }

    /// Cycles until standby `i`'s page cache holds `block`, failing with `what` if that
    /// takes longer than `within`.
    async fn cycle_until_os_holds(&mut self, i: usize, block: u32, within: Duration, what: &str) {
        let started = Instant::now();
        while !fake::lock(&self.standbys[i]).os_cached.contains(&block) {
            assert!(started.elapsed() < within, "{what}");
            self.cycle().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn holds_hot_set(&self, i: usize) -> bool {
        let hot: Vec<u32> = fake::lock(&self.primary).hot.keys().copied().collect();
        let standby = fake::lock(&self.standbys[i]);
        hot.iter().all(|b| standby.cached.contains(b))
    }

    fn up(&self, i: usize) -> f64 {
        let name = format!(
            "ccm_agent_standby_up{{node=\"127.0.0.1:{}\"}}",
            self.ports[i]
        );
        self.metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&name)?.trim().parse().ok())
            .unwrap_or(-1.0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_standby_holds_up_no_other() {
    let mut c = cluster(41000, 3);
    c.warm(&[0, 1, 2]).await;
    fake::lock(&c.standbys[1]).silent = true;

    // The cycle in which it goes silent waits for its answer at most a second.
    let (_, first) = c.cycle().await;
    assert!(
        first < Duration::from_millis(1500),
        "first cycle took {first:?}"
    );
    // Then the others' cycles take no time at all, and a new hot block reaches them.
    fake::lock(&c.primary).hot.insert(HOT + 1, 5);
    let (report, next) = c.cycle().await;
    assert!(
        next < Duration::from_millis(300),
        "next cycle took {next:?}"
    );
    assert_eq!(
        report.standbys.len(),
        2,
        "the two healthy standbys: {report:?}"
    );
    for i in [0, 2] {
        assert!(
            fake::lock(&c.standbys[i]).cached.contains(&(HOT + 1)),
            "standby {i}"
        );
    }
    assert!(!fake::lock(&c.standbys[1]).cached.contains(&(HOT + 1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_silent_for_long_is_shown_down_and_comes_back() {
    let mut c = cluster(41010, 2);
    c.warm(&[0, 1]).await;
    assert_eq!(c.up(1), 1.0);
    fake::lock(&c.standbys[1]).silent = true;
    // Past its call's deadline (3 s) and into its reconnects (1 s each): no cycle of the
    // other waits for it longer than the first step's wait (a second).
    let started = Instant::now();
    let mut longest = Duration::ZERO;
    while started.elapsed() < Duration::from_millis(5600) {
        let (_, took) = c.cycle().await;
        longest = longest.max(took);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        longest < Duration::from_millis(1500),
        "a cycle took {longest:?}"
    );
    assert_eq!(c.up(1), 0.0, "silent for over 5 s");
    assert_eq!(c.up(0), 1.0);
    // Its task ended at its call's deadline; once it answers, a new session finds it.
    fake::lock(&c.standbys[1]).silent = false;
    fake::lock(&c.primary).hot.insert(HOT + 2, 5);
    c.warm(&[0, 1]).await;
    assert_eq!(c.up(1), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_standby_holds_back_no_other() {
    let mut c = cluster(41020, 2);
    // The first standby reads slowly: 10 batches of 300 ms.
    fake::lock(&c.standbys[0]).batch_delay = Duration::from_millis(300);
    let (_, took) = c.cycle().await;
    assert!(
        took < Duration::from_millis(1500),
        "the cycle took {took:?}"
    );
    assert!(
        c.holds_hot_set(1),
        "the second standby is warm after one cycle"
    );
    assert!(!c.holds_hot_set(0));
    // The first one gets there in its own time.
    let cycles = c.warm(&[0, 1]).await;
    assert!(cycles > 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_mid_warm_ends_that_standby_only() {
    let mut c = cluster(41030, 2);
    fake::lock(&c.standbys[0]).promote_after = Some(2);
    let (report, _) = c.cycle().await;
    let standby = fake::lock(&c.standbys[0]);
    assert!(!standby.in_recovery);
    assert_eq!(
        standby.batches, 2,
        "nothing after the batch that saw the promotion"
    );
    drop(standby);
    assert!(c.holds_hot_set(1), "{report:?}");
    assert_eq!(c.up(0), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_conflict_ends_the_standbys_share_and_the_rest_comes_next_cycle() {
    let mut c = cluster(41040, 1);
    fake::lock(&c.standbys[0]).conflict_next = true;
    let (report, _) = c.cycle().await;
    assert_eq!(report.recovery_conflicts, 1);
    assert!(report.interrupted());
    assert_eq!(report.loaded, 0, "the conflict came on the first batch");
    // The cancelled batch goes out again with the rest, in the next cycle (not after the
    // feed's two sweeps that a batch sent and never confirmed waits for).
    let cycles = c.warm(&[0]).await;
    assert_eq!(cycles, 1, "the rest came in the next cycle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_change_feeds_go_on_across_a_reconnect_and_start_over_after_a_failover() {
    let mut c = cluster(41050, 2);
    c.warm(&[0, 1]).await;
    let resets = |n: &Node| fake::lock(n).resets;
    assert_eq!((resets(&c.primary), resets(&c.standbys[0])), (1, 1));
    // Every session closed (the nodes' network restarted, say): the same nodes go on.
    for node in [&c.primary, &c.standbys[0], &c.standbys[1]] {
        fake::lock(node).generation += 1;
    }
    c.warm(&[0, 1]).await;
    fake::lock(&c.primary).hot.insert(HOT + 3, 5);
    c.warm(&[0, 1]).await;
    assert_eq!(fake::lock(&c.primary).connections, 2);
    assert_eq!(fake::lock(&c.standbys[0]).connections, 2);
    assert_eq!((resets(&c.primary), resets(&c.standbys[0])), (1, 1));
    // The first standby is promoted and the old primary is gone: its feed as a primary
    // starts over, whatever the cursor of its feed as a standby was.
    fake::lock(&c.primary).refuse = true;
    fake::lock(&c.primary).generation += 1;
    {
        let mut s = fake::lock(&c.standbys[0]);
        s.in_recovery = false;
        s.hot = (0..HOT).map(|b| (b, 5)).collect();
    }
    let _ = c.syncer.cycle(None).await;
    let _ = c.syncer.cycle(None).await;
    assert_eq!(resets(&c.standbys[0]), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_agents_one_warms_and_the_other_takes_over_when_it_is_gone() {
    let mut c = cluster(41060, 1);
    c.warm(&[0]).await;
    let resets = |n: &Node| fake::lock(n).resets;
    assert_eq!((resets(&c.primary), resets(&c.standbys[0])), (1, 1));
    // A second agent on the same cluster, with its own subscriber id.
    let cfg = c.syncer.config();
    let metrics = Arc::new(Metrics::new());
    let mut second: Syncer<FakeNode> =
        Syncer::new(cfg.clone(), metrics.clone(), CancellationToken::new());
    for _ in 0..5 {
        let standing_by = second.cycle(None).await;
        assert!(
            matches!(standing_by, Err(crate::sync::CycleError::StandingBy { .. })),
            "{standing_by:?}"
        );
        c.cycle().await;
    }
    // It called no feed: neither node's feed started over.
    assert_eq!((resets(&c.primary), resets(&c.standbys[0])), (1, 1));
    // The first agent goes away (its sessions with it): the second one warms, after one
    // reset of each feed (a new subscriber).
    drop(c.syncer);
    fake::lock(&c.primary).hot.insert(HOT + 4, 5);
    let report = second.cycle(None).await.expect("the second agent warms");
    assert!(
        fake::lock(&c.standbys[0]).cached.contains(&(HOT + 4)),
        "{report:?}"
    );
    assert_eq!((resets(&c.primary), resets(&c.standbys[0])), (2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_of_another_system_is_refused_and_shown_down() {
    let mut c = cluster(41070, 1);
    fake::lock(&c.standbys[0]).system_identifier = "8".into();
    let refused = c.syncer.cycle(None).await;
    assert!(
        matches!(refused, Err(crate::sync::CycleError::Safety(_))),
        "{refused:?}"
    );
    let rendered = c.metrics.render();
    assert!(
        rendered.contains("ccm_agent_node_up{side=\"standby\"} 0"),
        "{rendered}"
    );
    assert_eq!(fake::lock(&c.standbys[0]).batches, 0);
}

/// The value of the series `name` (with its labels, if any) in `rendered`.
fn series(rendered: &str, name: &str) -> f64 {
    rendered
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no series {name} in\n{rendered}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_count_what_the_cycles_reports_say() {
    let mut c = cluster(41090, 2);
    fake::lock(&c.standbys[1]).conflict_next = true;
    let mut reports = Vec::new();
    for _ in 0..4 {
        reports.push(c.cycle().await.0);
    }
    assert!(c.holds_hot_set(0) && c.holds_hot_set(1), "{reports:?}");
    let sum = |f: fn(&CycleReport) -> u64| reports.iter().map(f).sum::<u64>() as f64;
    let rendered = c.metrics.render();
    assert_eq!(series(&rendered, "ccm_agent_cycles_total"), 4.0);
    let loaded = sum(|r| r.loaded);
    assert!(loaded >= f64::from(2 * HOT), "{reports:?}");
    assert_eq!(series(&rendered, "ccm_agent_blocks_loaded_total"), loaded);
    assert_eq!(
        series(&rendered, "ccm_agent_blocks_already_cached_total"),
        sum(|r| r.already_cached)
    );
    assert_eq!(
        series(&rendered, "ccm_agent_blocks_skipped_total"),
        sum(|r| r.skipped)
    );
    assert_eq!(
        series(&rendered, "ccm_agent_recovery_conflicts_total"),
        sum(|r| r.recovery_conflicts)
    );
    assert_eq!(sum(|r| r.recovery_conflicts), 1.0);
    for (i, name) in ["127.0.0.1:41091", "127.0.0.1:41092"].iter().enumerate() {
        let per_standby: u64 = reports
            .iter()
            .flat_map(|r| &r.standbys)
            .filter(|s| s.name == *name)
            .map(|s| s.loaded)
            .sum();
        let label = format!("ccm_agent_standby_blocks_loaded_total{{node=\"{name}\"}}");
        assert_eq!(series(&rendered, &label), per_standby as f64, "standby {i}");
        let coverage = format!("ccm_agent_standby_coverage_ratio{{node=\"{name}\"}}");
        assert_eq!(series(&rendered, &coverage), 1.0, "standby {i}");
    }
    let last = reports.last().expect("four reports");
    assert_eq!(
        series(&rendered, "ccm_agent_hot_set_blocks"),
        last.hot_buffers as f64
    );
    assert_eq!(series(&rendered, "ccm_agent_coverage_ratio"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_active_agent_tells_the_primary_each_candidates_state_and_coverage() {
    let mut c = cluster(41100, 2);
    c.warm(&[0, 1]).await;
    let rows = |c: &Cluster| {
        let s = fake::lock(&c.primary);
        let (agent, due_ms, rows) = s.candidates.clone().expect("a report on the primary");
        assert!(
            agent.ends_with(&format!(":{}", std::process::id())),
            "{agent}"
        );
        // The run loop's wait (here 300 ms) and a cycle (at least 1 s).
        assert_eq!(due_ms, 1300);
        rows.into_iter()
            .map(|r| (r.member, r.state.as_str(), r.coverage, r.missing_blocks))
            .collect::<Vec<_>>()
    };
    let _ = c.cycle().await;
    c.syncer.report_candidates(Duration::from_millis(300)).await;
    assert_eq!(
        rows(&c),
        vec![
            ("127.0.0.1:41101".to_string(), "up", Some(1.0), Some(0)),
            ("127.0.0.1:41102".to_string(), "up", Some(1.0), Some(0)),
        ]
    );
    // The second standby goes down: its row says so, without figures that no longer hold.
    {
        let mut s = fake::lock(&c.standbys[1]);
        s.refuse = true;
        s.generation += 1;
    }
    let _ = c.syncer.cycle(None).await;
    let _ = c.syncer.cycle(None).await;
    c.syncer.report_candidates(Duration::from_millis(300)).await;
    assert_eq!(
        rows(&c)[1],
        ("127.0.0.1:41102".to_string(), "down", None, None)
    );
    assert_eq!(rows(&c)[0].1, "up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_standing_by_writes_no_candidate_report() {
    let mut c = cluster(41110, 1);
    c.warm(&[0]).await;
    let cfg = c.syncer.config();
    let mut second: Syncer<FakeNode> =
        Syncer::new(cfg, Arc::new(Metrics::new()), CancellationToken::new());
    fake::lock(&c.primary).candidates = None;
    let standing_by = second.cycle(None).await;
    assert!(
        matches!(standing_by, Err(crate::sync::CycleError::StandingBy { .. })),
        "{standing_by:?}"
    );
    second.report_candidates(Duration::from_millis(200)).await;
    assert!(fake::lock(&c.primary).candidates.is_none());
    // The active one writes (the same call).
    c.syncer.report_candidates(Duration::from_millis(200)).await;
    assert!(fake::lock(&c.primary).candidates.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_cache_follows_the_hot_set_and_a_slow_standby_holds_up_no_other() {
    let mut c = cluster(41060, 2);
    fake::lock(&c.primary).os_cached = (0..5000).collect();
    c.warm(&[0, 1]).await;
    // A few cycles more: the page cache comes after the hot set, in batches.
    let started = Instant::now();
    let holds = |c: &Cluster, i: usize| {
        let want = fake::lock(&c.primary).os_cached.clone();
        want.is_subset(&fake::lock(&c.standbys[i]).os_cached)
    };
    while !(holds(&c, 0) && holds(&c, 1)) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the standbys' page caches never held the primary's"
        );
        c.cycle().await;
    }
    // The next pass confirms what the first read: every standby held all of it.
    let started = Instant::now();
    loop {
        c.cycle().await;
        let text = c.metrics.render();
        let share = |i: usize| {
            let name = format!(
                "ccm_agent_os_cache_coverage_ratio{{node=\"127.0.0.1:{}\"}}",
                c.ports[i]
            );
            text.lines()
                .find_map(|l| l.strip_prefix(&name)?.trim().parse::<f64>().ok())
        };
        if share(0) == Some(1.0) && share(1) == Some(1.0) {
            assert!(
                text.contains("ccm_agent_os_cache_primary_bytes 40960000"),
                "5000 blocks of 8 kB: {text}"
            );
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no complete pass: {text}"
        );
    }
    // A standby whose page-cache reads are slow (3 s a batch) holds up neither the page
    // cache of the other nor its hot set: the next slices go to the other without waiting.
    fake::lock(&c.standbys[1]).os_delay = Duration::from_secs(3);
    for (i, first) in [10_000, 20_000, 30_000].into_iter().enumerate() {
        fake::lock(&c.primary).os_cached.extend(first..first + 100);
        fake::lock(&c.primary).hot.insert(HOT + 1 + i as u32, 5);
        let started = Instant::now();
        while !fake::lock(&c.standbys[0]).os_cached.contains(&(first + 99)) {
            assert!(
                started.elapsed() < Duration::from_millis(2500),
                "the healthy standby's page cache waited for the slow one"
            );
            c.cycle().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(fake::lock(&c.standbys[0])
            .cached
            .contains(&(HOT + 1 + i as u32)));
    }
    assert!(!fake::lock(&c.standbys[1]).os_cached.contains(&30_099));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_without_the_page_cache_tier_holds_up_no_other() {
    let mut c = cluster(41070, 2);
    fake::lock(&c.standbys[1]).no_os_cache = true;
    fake::lock(&c.primary).os_cached = (0..3000).collect();
    c.warm(&[0, 1]).await;
    for first in [10_000, 20_000] {
        fake::lock(&c.primary).os_cached.extend(first..first + 100);
        let what = "the page cache of the standby with 0.9.0 waited for the one without";
        c.cycle_until_os_holds(0, first + 99, Duration::from_millis(2500), what)
            .await;
    }
    assert!(fake::lock(&c.standbys[1]).os_cached.is_empty());
    assert!(
        c.holds_hot_set(1),
        "its shared_buffers are warmed as before"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_busy_with_its_own_readers_waits_and_holds_up_no_other() {
    let mut c = cluster(41080, 2);
    fake::lock(&c.standbys[1]).busy_sessions = 1;
    fake::lock(&c.primary).os_cached = (0..3000).collect();
    c.warm(&[0, 1]).await;
    let waiting = |c: &Cluster| {
        series(
            &c.metrics.render(),
            &format!(
                "ccm_agent_os_cache_waiting{{node=\"127.0.0.1:{}\"}}",
                c.ports[1]
            ),
        )
    };
    for first in [10_000, 20_000] {
        fake::lock(&c.primary).os_cached.extend(first..first + 100);
        let what = "the page cache of the idle standby waited for the busy one";
        c.cycle_until_os_holds(0, first + 99, Duration::from_millis(2500), what)
            .await;
    }
    // Its batches are still measured: its passes complete and show what it holds (nothing).
    let coverage = format!(
        "ccm_agent_os_cache_coverage_ratio{{node=\"127.0.0.1:{}\"}} ",
        c.ports[1]
    );
    let started = Instant::now();
    while !c.metrics.render().contains(&coverage) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no complete pass of the busy standby"
        );
        c.cycle().await;
    }
    assert_eq!(series(&c.metrics.render(), coverage.trim_end()), 0.0);
    assert!(
        fake::lock(&c.standbys[1]).os_cached.is_empty(),
        "nothing was read into the page cache of a standby whose readers are busy"
    );
    assert_eq!(waiting(&c), 1.0);
    assert!(
        c.holds_hot_set(1),
        "its shared_buffers are warmed as before"
    );
    // Its readers done, its page cache catches up (after the pause that follows a pass in
    // which nothing was read: 300 ms here).
    fake::lock(&c.standbys[1]).busy_sessions = 0;
    let what = "the standby's page cache never caught up once its readers were idle";
    c.cycle_until_os_holds(1, 20_099, Duration::from_secs(5), what)
        .await;
    assert_eq!(waiting(&c), 0.0);
}
