//! `infernix-perplexity`: flags -> validated configuration -> `app::run` ->
//! exit code (0 success, 1 a check failed, 2 bad input or error).

use std::process::ExitCode;

use clap::Parser;
use infernix_perplexity::app::{self, Outcome};
use infernix_perplexity::cli::{Args, LogLevel};
use infernix_perplexity::config::RunConfig;

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

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.log_level);
    let result = RunConfig::from_args(&args).and_then(|cfg| {
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
            ExitCode::from(2)
        }
    }
}
