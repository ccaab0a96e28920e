//! `turbokv bench decode` end to end on the CPU: a random-weight smollm2-135m-shaped model,
//! tiny context; every reported rate must be positive and finite, and the extra step of
//! `--profile-step` (a no-op bracket on the CPU) must fit the cache the bench sized.

use std::process::Command;

#[test]
fn bench_decode_writes_positive_finite_json() {
    let dir = std::env::temp_dir().join(format!("turbokv-bench-decode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("decode.json");
    let out = Command::new(env!("CARGO_BIN_EXE_turbokv"))
        .args([
            "bench",
            "decode",
            "--device",
            "cpu",
            "--shape",
            "smollm2-135m",
            "--layers",
            "4",
            "--batch",
            "2",
            "--ctx",
            "16",
            "--steps",
            "2",
            "--profile-step",
            "--json",
        ])
        .arg(&json)
        .output()
        .expect("running turbokv");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("decode eager"), "{stdout}");
    assert!(stdout.contains("(pipelined)"), "{stdout}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in [
        "copy_bw_gb_s",
        "gemm_tflops",
        "weight_gb",
        "kv_gb",
        "prefill_tok_s",
        "prefill_tflops",
        "prefill_fraction_of_gemm",
        "decode_ms_step",
        "decode_tok_s",
        "roofline_ms",
        "ratio_to_roofline",
        "graph_ms_step",
        "graph_tok_s",
        "graph_ratio_to_roofline",
        "graph_greedy_ms_step",
        "pipelined_ms_step",
        "pipelined_tok_s",
        "pipelined_ratio_to_roofline",
    ] {
        let x = v[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key} missing: {v}"));
        assert!(x.is_finite() && x > 0.0, "{key} = {x}");
    }
    assert_eq!(v["batch"], 2);
    assert_eq!(v["ctx"], 16);
    assert_eq!(v["layers"], 4);
    assert_eq!(v["kv"], "bf16");
    assert!(v["device"].as_str().unwrap().starts_with("cpu"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_decode_rejects_unknown_shapes() {
    let out = Command::new(env!("CARGO_BIN_EXE_turbokv"))
        .args(["bench", "decode", "--device", "cpu", "--shape", "gpt-17"])
        .output()
        .expect("running turbokv");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown --shape"));
}
