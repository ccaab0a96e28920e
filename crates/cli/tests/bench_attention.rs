//! `turbokv bench attention --device cpu` end to end: a small shape, a plain 16-bit format, a
//! TurboQuant format and a preset with a window. Every point must report a positive finite
//! time, the f32-product variant must agree with the int8 products within their rounding,
//! and a device it does not know is an error that names the accepted ones.

use std::process::Command;

#[test]
fn bench_attention_on_the_cpu_times_every_format_and_checks_the_variants() {
    let dir = std::env::temp_dir().join(format!("turbokv-bench-attn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("attention.json");
    let out = Command::new(env!("CARGO_BIN_EXE_turbokv"))
        .args([
            "bench",
            "attention",
            "--device",
            "cpu",
            "--threads",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--kv",
            "bf16,tq3,balanced",
            "--batch",
            "1,2",
            "--ctx",
            "300",
            "--rounds",
            "2",
            "--compare-variants",
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
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v["device"].as_str().unwrap().starts_with("cpu"), "{v}");
    assert!(v["copy_bw_gb_s"].as_f64().unwrap() > 0.0);
    let rows = v["rows"].as_array().unwrap();
    // Three formats × two batches by default, the two compressed ones again with f32 products.
    assert_eq!(rows.len(), 6 + 4, "{v}");
    for r in rows {
        for key in ["ms", "best_ms", "kv_gb", "gb_s"] {
            let x = r[key].as_f64().unwrap();
            assert!(x.is_finite() && x > 0.0, "{key} = {x} in {r}");
        }
        assert!(r["best_ms"].as_f64() <= r["ms"].as_f64(), "{r}");
        let diff = r["max_diff_vs_default"].as_f64().unwrap();
        match r["variant"].as_str().unwrap() {
            "default" => assert_eq!(diff, 0.0),
            "f32-products" => {
                assert_ne!(r["kv"], "bf16");
                // Outputs are averages of values in [-1, 1); int8 products round the query
                // and the value weights to 8 bits.
                assert!(diff > 0.0 && diff < 0.02, "{r}");
            }
            other => panic!("unexpected variant {other}"),
        }
    }
    // bf16 reads 16 bits an element; tq3 about 3.5 with its norms.
    let gb = |kv: &str| {
        rows.iter()
            .find(|r| r["kv"] == kv && r["batch"] == 1)
            .unwrap()["kv_gb"]
            .as_f64()
            .unwrap()
    };
    assert!(gb("bf16") > 4.0 * gb("tq3"), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_attention_names_the_devices_it_runs_on() {
    let out = Command::new(env!("CARGO_BIN_EXE_turbokv"))
        .args(["bench", "attention", "--device", "tpu"])
        .output()
        .expect("running turbokv");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cuda, cuda:N or cpu") && err.contains("tpu"),
        "{err}"
    );
}

#[test]
fn bench_attention_refuses_kv_heads_of_other_widths() {
    // It times one layer in one format; dropping the heads would time another format.
    let out = Command::new(env!("CARGO_BIN_EXE_turbokv"))
        .args([
            "bench",
            "attention",
            "--device",
            "cpu",
            "--kv",
            "tq2,tq2[0.1:k3v2]",
            "--batch",
            "1",
            "--ctx",
            "64",
        ])
        .output()
        .expect("running turbokv");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tq2[0.1:k3v2]") && err.contains("bench decode"),
        "{err}"
    );
}
