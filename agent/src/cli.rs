//! Command-line surface. Every configuration key (declared once, in `config.rs`) is also a
//! global option that reads a `CCM_*` environment variable; all are `Option` so that
//! `config.rs` can tell "not given" from a default and apply the precedence
//! flag > env > file > default (clap itself already ranks a flag above its env variable).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::config::RawConfig;

#[derive(Debug, Parser)]
#[command(
    name = "ccm-agent",
    version,
    about = "Keeps a tier-0 standby's shared_buffers mirroring the primary's hot set (pg_ccm)",
    long_about = "Keeps a tier-0 standby's shared_buffers mirroring the primary's hot set.\n\n\
        Each cycle asks the standby for a bloom filter of the buffers it caches, asks the \
        primary for its hot blocks missing from that filter, and has the standby read them \
        in, in short bounded batches. Requires CREATE EXTENSION pg_ccm on the primary."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sync loop until SIGTERM/SIGINT, serving /metrics.
    Run,
    /// One full warm-up: cycles back to back until nothing is left to send.
    Sync(SyncArgs),
    /// Show both nodes, the hot set, the standby's coverage of it and the primary's CCM counters.
    Status(StatusArgs),
    /// Wait until the standbys (or --member) hold a share of the primary's hot set: exit 0,
    /// or 1 on timeout. For switchovers and rolling restarts instead of a fixed sleep.
    ///
    /// It looks every --interval, but at least 5 s apart, over one session per node kept
    /// from look to look. A look sweeps the primary's buffer headers once, and once more per
    /// standby, and each standby's once: per GB of shared_buffers full of hot pages, about
    /// 0.36 s of one core on the primary (with one standby) and 0.055 s on each standby.
    Wait(WaitArgs),
    /// Validate the configuration and print it as TOML (passwords masked).
    CheckConfig(CheckConfigArgs),
    /// Print a shell completion script or the man page, generated from these options.
    Generate(GenerateArgs),
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(subcommand)]
    pub what: Generated,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Generated {
    /// A completion script for SHELL (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// The man page ccm-agent(1), in roff.
    Man,
}

/// Writes what `generate` asks for to `out`.
pub fn generate(what: &Generated, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    use clap::CommandFactory;
    let mut command = Cli::command();
    match what {
        Generated::Completions { shell } => {
            clap_complete::generate(*shell, &mut command, "ccm-agent", out);
            Ok(())
        }
        Generated::Man => clap_mangen::Man::new(command).render(out),
    }
}

#[derive(Debug, Args)]
pub struct SyncArgs {
    /// Run once and exit (the only mode: `run` is the continuous loop).
    #[arg(long)]
    pub once: bool,
    /// Stop after this many cycles even if the standby is still missing blocks.
    #[arg(long, env = "CCM_MAX_CYCLES", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_cycles: u32,
    #[arg(long, value_enum, env = "CCM_OUTPUT", default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[arg(long, value_enum, env = "CCM_OUTPUT", default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
}

#[derive(Debug, Args)]
pub struct WaitArgs {
    /// The share of the primary's hot set to wait for, in percent.
    #[arg(long, value_name = "PCT", default_value_t = 99.0, value_parser = parse_percent)]
    pub min_coverage: f64,
    /// Also wait until each standby's page cache holds this share of the primary's page cache
    /// of relation files, in percent (extension 0.9.0 on the nodes). Each look then walks the
    /// primary's files and has each standby count what it holds of them.
    #[arg(long, value_name = "PCT", value_parser = parse_percent)]
    pub min_os_coverage: Option<f64>,
    /// Give up after this long (exit status 1).
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_timeout)]
    pub timeout: std::time::Duration,
    /// Wait for this standby only (Patroni's member name, or host:port), not for every
    /// failover candidate.
    #[arg(long, value_name = "NAME")]
    pub member: Option<String>,
}

fn parse_percent(text: &str) -> Result<f64, String> {
    match text.trim().trim_end_matches('%').parse::<f64>() {
        Ok(p) if (0.0..=100.0).contains(&p) => Ok(p),
        _ => Err(format!("\"{text}\" is not a percentage from 0 to 100")),
    }
}

fn parse_timeout(text: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("\"{text}\" is not a duration such as 90s or 10m ({e})"))
}

#[derive(Debug, Args)]
pub struct CheckConfigArgs {
    /// Also connect to both nodes and run the safety checks.
    #[arg(long)]
    pub connect: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Options shared by all commands; `global` so they may follow the subcommand too. The
/// configuration keys themselves are declared in `config.rs` (`config_keys!`).
#[derive(Debug, Default, Args)]
pub struct GlobalArgs {
    /// TOML configuration file (same keys as the flags, in snake_case).
    #[arg(long, env = "CCM_CONFIG", global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub keys: RawConfig,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_flags_after_subcommand() {
        let cli = Cli::try_parse_from([
            "ccm-agent",
            "run",
            "--primary",
            "host=p",
            "--standby",
            "host=s",
            "--interval",
            "200ms",
            "--metrics-listen",
            "127.0.0.1:1",
            "--max-backoff",
            "2s",
            "--log-level",
            "info,ccm_agent=debug",
        ])
        .unwrap();
        assert!(matches!(cli.command, Command::Run));
        assert_eq!(cli.global.keys.primary.as_deref(), Some("host=p"));
        assert_eq!(cli.global.keys.interval.as_deref(), Some("200ms"));
    }

    #[test]
    fn sync_and_status_flags() {
        let cli = Cli::try_parse_from([
            "ccm-agent",
            "sync",
            "--once",
            "--output",
            "json",
            "--max-cycles",
            "3",
        ])
        .unwrap();
        match cli.command {
            Command::Sync(a) => {
                assert!(a.once);
                assert_eq!(a.max_cycles, 3);
                assert_eq!(a.output, OutputFormat::Json);
            }
            other => panic!("{other:?}"),
        }
        let cli = Cli::try_parse_from(["ccm-agent", "status", "--output", "json"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Status(StatusArgs {
                output: OutputFormat::Json
            })
        ));
        let cli = Cli::try_parse_from(["ccm-agent", "check-config", "--connect"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::CheckConfig(CheckConfigArgs { connect: true })
        ));
        assert!(Cli::try_parse_from(["ccm-agent", "sync", "--max-cycles", "0"]).is_err());
        let cli = Cli::try_parse_from([
            "ccm-agent",
            "wait",
            "--min-coverage",
            "99.5",
            "--timeout",
            "2m",
            "--member",
            "pg2",
            "--min-os-coverage",
            "90",
        ])
        .unwrap();
        match cli.command {
            Command::Wait(a) => {
                assert_eq!(a.min_coverage, 99.5);
                assert_eq!(a.min_os_coverage, Some(90.0));
                assert_eq!(a.timeout, std::time::Duration::from_secs(120));
                assert_eq!(a.member.as_deref(), Some("pg2"));
            }
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["ccm-agent", "wait", "--min-coverage", "101"]).is_err());
    }
}

#[cfg(test)]
mod generate_tests {
    use super::*;

    fn generated(what: Generated) -> String {
        let mut out = Vec::new();
        generate(&what, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn man_page_and_completions_come_from_the_options() {
        let man = generated(Generated::Man);
        assert!(man.contains(".TH ccm-agent 1"), "{man}");
        assert!(
            man.contains("metrics\\-listen"),
            "every option is documented"
        );
        for shell in [
            clap_complete::Shell::Bash,
            clap_complete::Shell::Zsh,
            clap_complete::Shell::Fish,
        ] {
            let script = generated(Generated::Completions { shell });
            assert!(
                script.contains("check-config") && script.contains("standby"),
                "{shell}: {script}"
            );
        }
    }
}
