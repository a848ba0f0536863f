//! ccm-agent: keeps a tier-0 standby's shared_buffers mirroring the primary's hot set.
//!
//! This file only wires things up: parse flags, load the config, start logging, run the
//! command on a small tokio runtime, turn SIGTERM/SIGINT into a cancellation every task
//! watches and SIGHUP into a reload (reload.rs). The work lives in one module per concern.

mod backoff;
mod cli;
mod config;
mod conninfo;
#[cfg(test)]
mod cycle_tests;
mod election;
#[cfg(test)]
mod fake;
mod feed;
#[cfg(test)]
mod heap;
mod metrics;
mod node;
mod nodeapi;
mod notify;
mod oscache;
mod patroni;
mod pgpass;
mod reload;
mod report;
mod retry;
mod standby;
mod status;
mod sync;
mod tls;
mod topology;
mod wait;
mod walsender;
mod wire;
mod x509;

use std::future::Future;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn, Instrument};

use crate::cli::{Cli, Command, GlobalArgs, LogFormat, OutputFormat};
use crate::config::Config;
use crate::metrics::Metrics;

/// How long shutdown waits for tasks after cancelling them; calls cancel their statements
/// within half a second, so this is only a backstop.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Needs no configuration: for packagers, on a machine without one.
    if let Command::Generate(args) = &cli.command {
        return match cli::generate(&args.what, &mut std::io::stdout().lock()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ccm-agent: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let cfg = match Config::load(&cli.global) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("ccm-agent: configuration error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let set_log_level = init_logging(&cfg);
    log_panics();

    // Two workers: the machine this runs beside a database should give the database its cores.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("ccm-agent")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ccm-agent: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async_main(cli, Arc::new(cfg), set_log_level));
    runtime.shutdown_timeout(Duration::from_millis(500));
    code
}

/// Panics go to the log as one error event (a JSON object under `--log-format json`, where
/// the default hook's plain text would break the stream), with where and, when
/// RUST_BACKTRACE asks for it, the backtrace.
fn log_panics() {
    std::panic::set_hook(Box::new(|info| {
        let message = panic_message(info.payload());
        let location = info.location().map(ToString::to_string).unwrap_or_default();
        let thread = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_string();
        let backtrace = std::backtrace::Backtrace::capture();
        if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
            error!(%location, %thread, %backtrace, "panic: {message}");
        } else {
            error!(%location, %thread, "panic: {message}");
        }
    }));
}

/// A panic's message, whether it was a literal or formatted.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|text| text.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_string())
}

/// Starts logging; returns what changes the log filter of the running process (SIGHUP).
fn init_logging(cfg: &Config) -> reload::SetLogLevel {
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(config::DEFAULT_LOG_LEVEL));
    // Logs go to stderr: stdout carries the --output of sync, status and check-config.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    macro_rules! start {
        ($builder:expr) => {{
            let builder = $builder.with_filter_reloading();
            let handle = builder.reload_handle();
            builder.init();
            Box::new(move |level: &str| {
                let filter =
                    tracing_subscriber::EnvFilter::try_new(level).map_err(|e| e.to_string())?;
                handle.reload(filter).map_err(|e| e.to_string())
            })
        }};
    }
    match cfg.log_format {
        LogFormat::Json => start!(builder.json().flatten_event(true).with_current_span(false)),
        LogFormat::Text => start!(builder.with_ansi(std::io::stderr().is_terminal())),
    }
}

async fn async_main(cli: Cli, cfg: Arc<Config>, set_log_level: reload::SetLogLevel) -> ExitCode {
    let cancel = CancellationToken::new();
    spawn_signal_handler(cancel.clone());
    if !matches!(cli.command, Command::Run) {
        spawn_task("sighup", reload::ignore(cancel.clone()));
    }
    let result = match cli.command {
        Command::Run => run(cfg, cli.global, set_log_level, cancel).await,
        Command::Sync(args) => {
            if !args.once {
                eprintln!(
                    "ccm-agent: sync needs --once (use `ccm-agent run` for the continuous loop)"
                );
                return ExitCode::from(2);
            }
            sync_once(cfg, cancel, args.max_cycles, args.output).await
        }
        Command::Status(args) => status(cfg, cancel, args.output).await,
        Command::Wait(args) => wait(cfg, cancel, args).await,
        Command::CheckConfig(args) => check_config(cfg, cancel, args.connect).await,
        Command::Generate(_) => unreachable!("handled before the configuration is loaded"),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

/// SIGTERM or SIGINT cancels everything, and the command ends as it would have (0 for a
/// clean stop of `run`); a second one exits at once, with the shell's code for the signal
/// (143 for SIGTERM, 130 for SIGINT).
fn spawn_signal_handler(cancel: CancellationToken) {
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    warn!("cannot watch SIGTERM: {e}");
                    return;
                }
            };
        for n in 0.. {
            let (name, code) = tokio::select! {
                _ = term.recv() => ("SIGTERM", 128 + 15),
                r = tokio::signal::ctrl_c() => { if r.is_err() { return; } ("SIGINT", 128 + 2) }
            };
            if n == 0 {
                info!("{name} received; shutting down");
                cancel.cancel();
            } else {
                warn!("{name} received again; exiting now");
                std::process::exit(code);
            }
        }
    });
}

/// A task with a name: its logs carry `task=NAME`, and its end is logged.
fn spawn_task<F>(name: &'static str, future: F) -> JoinHandle<anyhow::Result<()>>
where
    F: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    tokio::spawn(
        async move {
            let result = future.await;
            if let Err(e) = &result {
                error!("task failed: {e:#}");
            }
            result
        }
        .instrument(tracing::info_span!("task", task = name)),
    )
}

async fn run(
    cfg: Arc<Config>,
    args: GlobalArgs,
    set_log_level: reload::SetLogLevel,
    cancel: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let metrics = Arc::new(Metrics::new());
    let (config_tx, config_rx) = tokio::sync::watch::channel(cfg.clone());
    let reload_task = spawn_task(
        "reload",
        reload::run(args, config_tx, set_log_level, cancel.clone()),
    );
    let metrics_task = match cfg.metrics_listen {
        Some(addr) => {
            // Bound here, not in the task: a busy port must fail the start, visibly.
            let listener = metrics::bind(addr).await?;
            Some(spawn_task(
                "metrics",
                metrics::serve(listener, metrics.clone(), cancel.clone()),
            ))
        }
        None => None,
    };
    let mut sync_task = spawn_task(
        "sync",
        sync::run(config_rx, metrics.clone(), cancel.clone()),
    );
    // Under systemd (Type=notify): serving now; the watchdog is fed while the loop lives.
    notify::notify("READY=1");
    let watchdog_task = notify::watchdog_period().map(|period| {
        spawn_task(
            "watchdog",
            feed_watchdog(period, metrics.clone(), cancel.clone()),
        )
    });

    // Wait for shutdown, or for the sync task to end on its own (which only a bug makes happen).
    let mut failed = false;
    let early = tokio::select! {
        biased;
        _ = cancel.cancelled() => None,
        r = &mut sync_task => Some(r),
    };
    let mut pending = Vec::new();
    match early {
        Some(r) => {
            if !cancel.is_cancelled() {
                error!("the sync task ended unexpectedly; shutting down");
                cancel.cancel();
            }
            failed = !matches!(r, Ok(Ok(())));
        }
        None => pending.push(("sync", sync_task)),
    }
    notify::notify("STOPPING=1");
    pending.extend(metrics_task.map(|t| ("metrics", t)));
    pending.extend(watchdog_task.map(|t| ("watchdog", t)));
    pending.push(("reload", reload_task));
    for (name, task) in pending {
        match tokio::time::timeout(SHUTDOWN_GRACE, task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(_))) => failed = true,
            Ok(Err(e)) => {
                error!("task {name} panicked: {e}");
                failed = true;
            }
            Err(_) => warn!("task {name} did not stop within {SHUTDOWN_GRACE:?}; abandoning it"),
        }
    }
    info!("stopped");
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Sends WATCHDOG=1 every half period while the sync loop shows life within the period, so
/// that systemd restarts an agent whose loop hangs (never one that waits for a node).
async fn feed_watchdog(
    period: Duration,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(period / 2);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        match metrics.since_heartbeat() {
            Some(age) if age < period => notify::notify("WATCHDOG=1"),
            age => warn!(
                ?age,
                "the sync loop shows no life; not feeding systemd's watchdog"
            ),
        }
    }
}

async fn sync_once(
    cfg: Arc<Config>,
    cancel: CancellationToken,
    max_cycles: u32,
    output: OutputFormat,
) -> anyhow::Result<ExitCode> {
    let metrics = Arc::new(Metrics::new());
    let progress = if std::io::stderr().is_terminal() {
        let pb = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        pb.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {pos}/{len} blocks {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        pb
    } else {
        ProgressBar::hidden()
    };
    let result = sync::sync_once(cfg, metrics, cancel, max_cycles, &progress).await;
    progress.finish_and_clear();
    let summary = result.context("sync failed")?;
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string(&summary)?),
        OutputFormat::Text => println!("{}", summary.to_text()),
    }
    Ok(ExitCode::SUCCESS)
}

async fn status(
    cfg: Arc<Config>,
    cancel: CancellationToken,
    output: OutputFormat,
) -> anyhow::Result<ExitCode> {
    let report = status::gather(cfg, cancel).await;
    match output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        OutputFormat::Text => print!("{}", report.to_text()),
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

async fn wait(
    cfg: Arc<Config>,
    cancel: CancellationToken,
    args: cli::WaitArgs,
) -> anyhow::Result<ExitCode> {
    let outcome = wait::wait(
        cfg,
        cancel,
        args.min_coverage / 100.0,
        args.min_os_coverage.map(|pct| pct / 100.0),
        args.timeout,
        args.member.as_deref(),
    )
    .await;
    Ok(match outcome {
        Ok(message) => {
            println!("{message}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("ccm-agent: {message}");
            ExitCode::FAILURE
        }
    })
}

async fn check_config(
    cfg: Arc<Config>,
    cancel: CancellationToken,
    connect: bool,
) -> anyhow::Result<ExitCode> {
    print!("{}", cfg.to_toml_masked());
    if !connect {
        return Ok(ExitCode::SUCCESS);
    }
    let (lines, ok) = status::check_connections(cfg, cancel).await;
    for line in lines {
        eprintln!("{line}");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_messages_are_read_either_way() {
        let literal: Box<dyn std::any::Any + Send> = Box::new("index out of bounds");
        assert_eq!(panic_message(&*literal), "index out of bounds");
        let formatted: Box<dyn std::any::Any + Send> = Box::new(format!("bad value {}", 7));
        assert_eq!(panic_message(&*formatted), "bad value 7");
        let other: Box<dyn std::any::Any + Send> = Box::new(42u8);
        assert_eq!(panic_message(&*other), "(no message)");
    }
}
