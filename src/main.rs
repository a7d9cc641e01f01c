//! `infernix-perplexity`: flags -> validated configuration -> `app::run` ->
//! exit code (0 success, 1 a check failed, 2 bad input or error).
//!
//! `infernix-perplexity compare BASE NEW` is dispatched on the first argument
//! before any parsing (clap cannot mix the positional MODEL with
//! subcommands); its exit codes are 0 PASS, 3 WARN, 1 FAIL, 2 error.
//! `infernix-perplexity merge OUT_DIR SHARD_DIR...` is dispatched the same
//! way (exit 0, or 2 on any error).
//! SIGINT/SIGTERM stop a run at the next window (`util::signal`): exit 130/143.

use std::process::ExitCode;

use clap::Parser;
use infernix_perplexity::app::{self, Outcome};
use infernix_perplexity::cli::{Args, LogLevel};
use infernix_perplexity::config::RunConfig;
use infernix_perplexity::util::signal;

fn init_logging(level: LogLevel) {
    let level = match level {
        LogLevel::Error => tracing::Level::ERROR,
        LogLevel::Warn => tracing::Level::WARN,
        LogLevel::Info => tracing::Level::INFO,
        LogLevel::Debug => tracing::Level::DEBUG,
        LogLevel::Trace => tracing::Level::TRACE,
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// `infernix-perplexity compare ...`: the quality gate between two reports.
fn compare_main(argv: Vec<std::ffi::OsString>) -> ExitCode {
    use infernix_perplexity::compare::{self, CompareArgs};
    // Usage errors exit 2 (clap's code for errors), --help and --version 0.
    let args = CompareArgs::parse_from(argv);
    init_logging(LogLevel::Warn);
    match compare::run(&args) {
        Ok(c) => ExitCode::from(c.exit_code),
        Err(e) => {
            eprintln!("infernix-perplexity compare: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// `infernix-perplexity merge OUT_DIR SHARD_DIR...`: joins `--shard` reports.
fn merge_main(argv: Vec<std::ffi::OsString>) -> ExitCode {
    use infernix_perplexity::merge::{self, MergeArgs};
    let args = MergeArgs::parse_from(argv);
    init_logging(LogLevel::Warn);
    match merge::run(&args) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("infernix-perplexity merge: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // `help` and `help compare`, as users of subcommand CLIs type them.
    if argv.get(1).is_some_and(|a| a == "help") {
        let program = argv[0].clone();
        argv = match argv.get(2) {
            Some(a) if a == "compare" => vec![program, "compare".into(), "--help".into()],
            Some(a) if a == "merge" => vec![program, "merge".into(), "--help".into()],
            _ => vec![program, "--help".into()],
        };
    }
    if argv.get(1).is_some_and(|a| a == "compare") {
        // "infernix-perplexity compare" becomes the program name in usage lines.
        argv.remove(0);
        return compare_main(argv);
    }
    if argv.get(1).is_some_and(|a| a == "merge") {
        argv.remove(0);
        return merge_main(argv);
    }
    let args = Args::parse_from(argv);
    init_logging(args.log_level);
    let result = signal::install().and_then(|()| RunConfig::from_args(&args)).and_then(|cfg| {
        if let Some(n) = args.threads {
            rayon::ThreadPoolBuilder::new().num_threads(n).build_global().ok();
        }
        app::run(&cfg)
    });
    match result {
        Ok(Outcome::Success) => ExitCode::SUCCESS,
        Ok(Outcome::ChecksFailed) => ExitCode::from(1),
        Err(e) => {
            eprintln!("infernix-perplexity: error: {e:#}");
            ExitCode::from(signal::exit_code_for(&e, 2))
        }
    }
}
