//! The `turbokv` binary's KV cache options end to end: bad input gives errors that list what
//! is accepted, `--key-mode prod` builds a prod cache, `--kv-center` calibrates and labels.
//! Tests that need the demo model (or the wiki text) skip with a message when it is absent.

mod common;

use common::{asset, demo_model, stderr, turbokv};

/// The `B/token` figure of `run`'s stats line.
fn bytes_per_token(stderr: &str, label: &str) -> f64 {
    let at = stderr
        .find(&format!("KV {label} "))
        .unwrap_or_else(|| panic!("no `KV {label}` in the stats line: {stderr}"));
    stderr[at..]
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no B/token after `KV {label}`: {stderr}"))
}

#[test]
fn an_unknown_dtype_is_refused_with_the_accepted_ones() {
    // Refused before the model is even looked for.
    for args in [
        &["run", "--prompt", "hi", "--kv", "tq9"][..],
        &["eval", "ppl", "--kv", "f16,q4_0"][..],
        &["bench", "model", "--kv", "tq4/fast"][..],
    ] {
        let o = turbokv(args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?} must fail");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let listed = if args.contains(&"tq4/fast") {
            vec!["mse", "prod"]
        } else {
            vec!["bf16, f16, int8", "tq{b}", "k{b}v{b}", "balanced, compact"]
        };
        for want in listed {
            assert!(err.contains(want), "{args:?}: `{want}` missing from {err}");
        }
    }
}

#[test]
fn a_layer_override_outside_the_model_is_refused_with_the_valid_range() {
    let Some(model) = demo_model() else { return };
    for args in [
        &[
            "run",
            "--model",
            &model,
            "--prompt",
            "hi",
            "--kv",
            "tq4",
            "--kv-layers",
            "30:bf16",
        ][..],
        &[
            "run",
            "--model",
            &model,
            "--prompt",
            "hi",
            "--kv-layers",
            "-31:bf16",
        ][..],
        &[
            "eval",
            "ppl",
            "--model",
            &model,
            "--kv",
            "tq3",
            "--kv-layers",
            "0:bf16,30:int8",
        ][..],
    ] {
        let o = turbokv(args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?} must fail");
        for want in ["--kv-layers", "30 layers", "0..=29", "-30..=-1"] {
            assert!(err.contains(want), "{args:?}: `{want}` missing from {err}");
        }
    }
}

#[test]
fn key_mode_prod_builds_a_prod_cache() {
    let Some(model) = demo_model() else { return };
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            &model,
            "--raw",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "2",
        ];
        args.extend(extra);
        let o = turbokv(&args);
        let err = stderr(&o);
        assert!(o.status.success(), "{args:?}: {err}");
        err
    };
    let mse = bytes_per_token(&run(&["--kv", "tq4"]), "tq4");
    let prod = bytes_per_token(&run(&["--kv", "tq4", "--key-mode", "prod"]), "tq4/prod");
    let suffix = bytes_per_token(&run(&["--kv", "tq4/prod"]), "tq4/prod");
    // Demo model: 30 layers × 3 kv heads × d 64 = 5760 elements each of K and V per token.
    // Keys 4.25 bits (mse) or 4.5 (prod: a second f16 scalar, the residual norm); values 4.25
    // either way. mse: 5760·(4.25 + 4.25)/8 = 6120 B; prod: 5760·(4.5 + 4.25)/8 = 6300 B.
    assert_eq!(mse, 6120.0);
    assert_eq!(prod, 6300.0);
    assert_eq!(suffix, prod);
}

#[test]
fn kv_center_calibrates_and_labels_the_cache() {
    let Some(model) = demo_model() else { return };
    let o = turbokv(&[
        "run",
        "--model",
        &model,
        "--raw",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "4",
        "--kv",
        "tq3",
        "--kv-center",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("calibrating the KV cache"), "{err}");
    assert!(err.contains("KV tq3@w0s1+c "), "{err}");

    let Some(text) = asset("TURBOKV_WIKI", "data/wiki.txt") else {
        return;
    };
    let text = text.display().to_string();
    let o = turbokv(&[
        "eval",
        "ppl",
        "--model",
        &model,
        "--text",
        &text,
        "--ctx",
        "64",
        "--windows",
        "1",
        "--kv",
        "tq4/prod,tq3+c,tq3",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    let row = |label: &str| {
        rows.iter()
            .find(|r| r.first() == Some(&label))
            .unwrap_or_else(|| panic!("no row {label} in {out}"))
    };
    assert_eq!(row("tq4/prod")[1], "4.375", "{out}");
    // Centering keeps the sink exact and pays for its centers: 3.25 + 16·1/64 + 32/64.
    assert_eq!(row("tq3@w0s1+c")[1], "4.000", "{out}");
    assert_eq!(row("tq3")[1], "3.250", "{out}");
    // Every quality figure is a number.
    for label in ["bf16", "tq4/prod", "tq3@w0s1+c", "tq3"] {
        for cell in &row(label)[1..6] {
            let x: f64 = cell.trim_end_matches('%').parse().expect("number");
            assert!(x.is_finite(), "{label}: {cell}");
        }
    }
}

/// A scratch directory for a sensitivity probe and, in it, `own.txt`: one short calibration
/// text of the test's own, which keeps the probes cheap.
fn probe_dir(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("turbokv-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let own = dir.join("own.txt");
    std::fs::write(
        &own,
        "The ferry leaves at seven; bring a coat, the deck is cold.",
    )
    .unwrap();
    (dir, own)
}

#[test]
fn eval_sensitivity_probes_every_layer_and_proposes_overrides_within_the_budget() {
    let Some(model) = demo_model() else { return };
    let (dir, own) = probe_dir("sens");
    let json = dir.join("sens.json");
    let o = turbokv(&[
        "eval",
        "sensitivity",
        "--model",
        &model,
        "--text",
        own.to_str().unwrap(),
        "--kv",
        "k4v2@w2s1",
        "--ctx",
        "12",
        "--steps",
        "-1,1",
        "--budget",
        "3.3",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // 30 layers: keys 4 → 3 (4 → 5 does not exist), values 2 → 1 and 2 → 3.
    let probes = doc["probes"].as_array().unwrap();
    assert_eq!(probes.len(), 90);
    assert_eq!(doc["texts"][0], "own");
    for p in probes {
        let to: &str = p["to"].as_str().unwrap();
        assert!(["k3v2", "k4v1", "k4v3"].contains(&to), "{to}");
    }
    let proposal = &doc["proposal"];
    assert!(proposal["bits_per_element"].as_f64().unwrap() <= 3.3 + 1e-9);
    assert!(proposal["overrides"].as_str().unwrap().starts_with('['));
    // A calibration text taken from the evaluation set is refused.
    if let Some(code) = asset("TURBOKV_EVAL_CODE", "data/eval/code.txt") {
        let copy = dir.join("mine.txt");
        let body = std::fs::read_to_string(&code).unwrap();
        std::fs::write(&copy, &body[..body.len().min(20_000)]).unwrap();
        let o = turbokv(&[
            "eval",
            "sensitivity",
            "--model",
            &model,
            "--text",
            copy.to_str().unwrap(),
        ]);
        let err = stderr(&o);
        assert!(
            !o.status.success() && err.contains("shares text with the evaluation text"),
            "{err}"
        );
    }
}

#[test]
fn eval_sensitivity_ranks_kv_heads_and_their_overrides_evaluate_in_a_list() {
    let Some(model) = demo_model() else { return };
    let (dir, own) = probe_dir("heads");
    let json = dir.join("heads.json");
    let o = turbokv(&[
        "eval",
        "sensitivity",
        "--model",
        &model,
        "--text",
        own.to_str().unwrap(),
        "--kv",
        "tq3@w2s1",
        "--ctx",
        "12",
        "--steps",
        "-1",
        "--heads",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // 30 layers × 3 kv heads × (keys, values), each one step down.
    let probes = doc["probes"].as_array().unwrap();
    assert_eq!(probes.len(), 180);
    let merit = |p: &serde_json::Value| {
        (p["delta_kl"].as_f64().unwrap() / p["delta_bits"].as_f64().unwrap()).abs()
    };
    for (i, p) in probes.iter().enumerate() {
        assert!(p["head"].as_u64().unwrap() < 3);
        assert!(["k2v3", "k3v2"].contains(&p["to"].as_str().unwrap()));
        // One head's keys (or values) one bit down: a sixth of a bit of its layer, over 30.
        let bits = p["delta_bits"].as_f64().unwrap();
        assert!((bits + 1.0 / 6.0 / 30.0).abs() < 1e-9, "{bits}");
        if i > 0 {
            assert!(merit(&probes[i - 1]) >= merit(p), "ranked by ΔKL per bit");
        }
    }
    let o = turbokv(&[
        "eval",
        "sensitivity",
        "--model",
        &model,
        "--heads",
        "--budget",
        "3",
    ]);
    assert!(!o.status.success() && stderr(&o).contains("--budget allocates whole layers"));

    // The top-ranked head's override, in a --kv list beside the plain format: its commas stay
    // inside the brackets, and its bits are counted (keys of 1 head in 90 at 4 bits).
    let top = &probes[0];
    let target = format!("{}.{}", top["layer"], top["head"]);
    let Some(text) = asset("TURBOKV_EVAL_WIKI", "data/eval/wiki.txt") else {
        return;
    };
    let spec = format!("tq3@w2s1[{target},0.0:k4v3]");
    let o = turbokv(&[
        "eval",
        "ppl",
        "--model",
        &model,
        "--text",
        text.to_str().unwrap(),
        "--ctx",
        "48",
        "--windows",
        "1",
        "--kv",
        &format!("tq3@w2s1,{spec}"),
    ]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", stderr(&o));
    let bits = |label: &str| -> f64 {
        let line = out
            .lines()
            .map(str::trim_start)
            .find(|l| l.starts_with(label));
        let line = line.unwrap_or_else(|| panic!("no {label} row in {out}"));
        line[label.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let plain = bits("tq3@w2s1 ");
    let heads = bits(&spec);
    let want = if target == "0.0" { 1.0 } else { 2.0 } * 0.5 / 3.0 / 30.0;
    assert!((heads - plain - want).abs() < 1.5e-3, "{out}");
}
