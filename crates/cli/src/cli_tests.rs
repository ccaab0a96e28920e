//! Argument parsing of the KV cache options on every command that takes `--kv`.

use clap::Parser;
use turbokv_codec::KeyMode;

use crate::args::{BenchCommand, CacheArgs, Cli, Command, EvalCommand, KeyModeArg, KvOptArgs};

fn parse(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("turbokv").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

fn cache_of(cli: &Cli) -> (&CacheArgs, &KvOptArgs) {
    match &cli.command {
        Command::Run(a) => (&a.cache, &a.cache.kv_opts),
        Command::Chat(a) => (&a.cache, &a.cache.kv_opts),
        Command::Bench(BenchCommand::Model(a)) => (&a.cache, &a.cache.kv_opts),
        other => panic!("no cache args in {other:?}"),
    }
}

#[test]
fn key_mode_center_and_layers_on_run_chat_and_bench_model() {
    let commands: [&[&str]; 3] = [&["run", "--prompt", "hi"], &["chat"], &["bench", "model"]];
    for cmd in commands {
        let plain = parse(cmd);
        let (cache, opts) = cache_of(&plain);
        assert_eq!(opts.key_mode, KeyModeArg::Mse, "{cmd:?}: mse by default");
        assert!(!opts.kv_center);
        assert_eq!(cache.kv_layers, "");
        let mut full = cmd.to_vec();
        full.extend([
            "--kv",
            "tq4",
            "--key-mode",
            "prod",
            "--kv-center",
            "--kv-layers",
            "-1:bf16",
        ]);
        let cli = parse(&full);
        let (cache, opts) = cache_of(&cli);
        assert_eq!(KeyMode::from(opts.key_mode), KeyMode::Prod, "{cmd:?}");
        assert!(opts.kv_center, "{cmd:?}");
        assert_eq!(
            cache.kv_layers, "-1:bf16",
            "{cmd:?}: a negative layer is a value"
        );
    }
}

#[test]
fn key_mode_and_center_on_eval_ppl() {
    let cli = parse(&[
        "eval",
        "ppl",
        "--kv",
        "tq4,tq3+c",
        "--key-mode",
        "prod",
        "--kv-center",
    ]);
    let Command::Eval(EvalCommand::Ppl(a)) = &cli.command else {
        panic!("eval ppl")
    };
    assert_eq!(crate::kvspec::split_list(&a.kv), ["tq4", "tq3+c"]);
    assert_eq!(a.kv_opts.key_mode, KeyModeArg::Prod);
    assert!(a.kv_opts.kv_center);
    let cli = parse(&["eval", "ppl", "--kv-layers", "-1:bf16"]);
    let Command::Eval(EvalCommand::Ppl(a)) = &cli.command else {
        panic!("eval ppl")
    };
    assert_eq!(a.kv_opts.key_mode, KeyModeArg::Mse);
    assert_eq!(a.kv_layers, "-1:bf16");
}

#[test]
fn an_unknown_key_mode_lists_the_accepted_ones() {
    let err = Cli::try_parse_from(["turbokv", "run", "--prompt", "x", "--key-mode", "qjl2"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("mse") && err.contains("prod"), "{err}");
}
