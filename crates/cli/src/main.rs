//! The `turbokv` command line: run, chat, serve, bench, eval.

mod args;
mod attention_plot;
mod bench_attention;
mod bench_attention_cpu;
#[macro_use]
mod generate;
mod bench_codec;
mod bench_decode;
mod bench_model;
#[cfg(test)]
mod cli_tests;
mod env_options;
mod eval;
mod eval_tokens;
mod kvspec;
mod plot;
mod random_model;
mod sensitivity;
mod serve;

use anyhow::{Context, Result};
use clap::Parser;

use args::{BenchCommand, Cli, Command, EvalCommand};

fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    // Run the whole command on a worker of the pool: a parallel op issued from a worker runs
    // its first piece inline and steals the rest, whereas one issued from outside the pool is
    // injected and the caller sleeps until it is done — a wake-up per op, ~100 ops a token.
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads(&cli.command) {
        pool = pool.num_threads(n);
    }
    let pool = pool.build().context("building the thread pool")?;
    pool.install(|| dispatch(cli.command))
}

fn threads(cmd: &Command) -> Option<usize> {
    match cmd {
        Command::Run(a) => a.model.threads,
        Command::Chat(a) => a.model.threads,
        Command::Bench(BenchCommand::Model(a)) => a.model.threads,
        Command::Eval(EvalCommand::Ppl(a)) => a.model.threads,
        Command::Eval(EvalCommand::Sensitivity(a)) => a.model.threads,
        Command::Bench(BenchCommand::Codec { .. }) => None,
        Command::Bench(BenchCommand::Decode(a)) => a.threads,
        Command::Bench(BenchCommand::Attention(a)) => a.threads,
        Command::Serve(a) => a.model.threads,
    }
}

fn dispatch(command: Command) -> Result<()> {
    match command {
        Command::Run(a) => generate::run(&a),
        Command::Chat(a) => generate::chat(&a),
        Command::Bench(BenchCommand::Codec { json }) => bench_codec::run(json.as_deref()),
        Command::Bench(BenchCommand::Model(a)) => bench_model::run(&a),
        Command::Bench(BenchCommand::Decode(a)) => bench_decode::run(&a),
        Command::Bench(BenchCommand::Attention(a)) => bench_attention::run(&a),
        Command::Eval(EvalCommand::Ppl(a)) => eval::run(&a),
        Command::Eval(EvalCommand::Sensitivity(a)) => sensitivity::run(&a),
        Command::Serve(a) => serve::run(&a),
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("TURBOKV_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
