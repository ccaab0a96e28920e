//! The `turbokv` command line: run, chat, bench, eval.

mod args;
mod bench_codec;
mod bench_model;
mod eval;
mod generate;

use anyhow::Result;
use clap::Parser;

use args::{BenchCommand, Cli, Command, EvalCommand};

fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match cli.command {
        Command::Run(a) => generate::run(&a),
        Command::Chat(a) => generate::chat(&a),
        Command::Bench(BenchCommand::Codec { json }) => bench_codec::run(json.as_deref()),
        Command::Bench(BenchCommand::Model(a)) => bench_model::run(&a),
        Command::Eval(EvalCommand::Ppl(a)) => eval::run(&a),
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
