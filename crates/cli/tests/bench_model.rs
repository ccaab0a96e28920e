//! `turbokv bench model --interleave` end to end on the demo model: every cache gets its own
//! row, in the order given, with positive finite rates; a run that would overflow the
//! model's context, names a bad spec or an empty prompt is refused with a message and no
//! panic.

mod common;

use std::process::Output;

use common::{demo_model, stderr, turbokv};

/// `turbokv bench model` on `model` with 2 threads and a bf16 `--kv`, then `extra`.
fn bench_model(model: &str, extra: &[&str]) -> Output {
    let base = [
        "bench",
        "model",
        "--model",
        model,
        "--threads",
        "2",
        "--kv",
        "bf16",
    ];
    let args: Vec<&str> = base.iter().chain(extra).copied().collect();
    turbokv(&args)
}

#[test]
fn interleaved_caches_each_get_a_row_in_order() {
    let Some(model) = demo_model() else { return };
    let dir = std::env::temp_dir().join(format!("turbokv-bench-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("interleaved.json");
    let o = bench_model(
        &model,
        &[
            "--interleave",
            "tq3,compact",
            "--prompt-tokens",
            "48",
            "--gen-tokens",
            "3",
            "--repeats",
            "2",
            "--ctx",
            "256",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = doc["rows"].as_array().expect("rows");
    let labels: Vec<&str> = rows.iter().map(|r| r["kv"].as_str().unwrap()).collect();
    assert_eq!(labels.len(), 3, "{labels:?}");
    assert_eq!(&labels[..2], ["bf16", "tq3"]);
    assert!(labels[2].starts_with("compact("), "{labels:?}");
    for r in rows {
        assert_eq!(r["prompt_tokens"], 48);
        assert_eq!(r["gen_tokens"], 3);
        for key in ["prefill_tok_s", "decode_tok_s", "decode_ms_per_token"] {
            let x = r[key].as_f64().unwrap();
            assert!(x.is_finite() && x > 0.0, "{key} = {x} in {r}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn interleave_past_the_context_a_bad_spec_or_an_empty_prompt_is_refused() {
    let Some(model) = demo_model() else { return };
    let cases: [(&[&str], &str); 3] = [
        (
            &[
                "--interleave",
                "tq3",
                "--prompt-tokens",
                "8000",
                "--gen-tokens",
                "100",
                "--repeats",
                "3",
            ],
            "exceed the model's context",
        ),
        (
            &["--interleave", "tq3,tq9", "--prompt-tokens", "16"],
            "k{b}v{b}",
        ),
        (
            &["--interleave", "tq3", "--prompt-tokens", "16,0"],
            "at least 1",
        ),
    ];
    for (extra, want) in cases {
        let o = bench_model(&model, extra);
        let err = stderr(&o);
        assert!(!o.status.success(), "{extra:?} must fail");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: `{want}` missing from {err}");
    }
}
