//! Parity with llama.cpp on the SmolLM2 GGUF vocabulary (`gpt2` BPE, pre `smollm`).
//!
//! The fixture `fixtures/tokenizer_smollm2.json` holds llama.cpp's ids for each string with
//! special parsing on and off (made by `scripts/make_fixtures.py`). The model file comes from
//! `TURBOKV_MODEL`, else `${TURBOKV_CACHE:-$HOME/.cache/turbokv}/models/SmolLM2-135M-Instruct.Q4_1.gguf`;
//! without it the tests print a message and pass.

use std::path::PathBuf;

use serde_json::Value;
use turbokv_model::gguf::GgufFile;
use turbokv_model::tokenizer::{TokenKind, Tokenizer};

fn model_path() -> Option<PathBuf> {
    let path = match std::env::var_os("TURBOKV_MODEL") {
        Some(p) => PathBuf::from(p),
        None => {
            let cache = std::env::var_os("TURBOKV_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/turbokv"))
                })?;
            cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
        }
    };
    if path.exists() {
        Some(path)
    } else {
        println!(
            "SKIPPED: model file {} is absent (set TURBOKV_MODEL)",
            path.display()
        );
        None
    }
}

fn tokenizer() -> Option<Tokenizer> {
    let path = model_path()?;
    let gguf = GgufFile::open(&path).expect("open the GGUF");
    Some(Tokenizer::from_gguf(&gguf.metadata).expect("build the tokenizer"))
}

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tokenizer_smollm2.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("read the fixture"))
        .expect("fixture JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn every_fixture_string_encodes_like_llama_cpp() {
    let Some(tok) = tokenizer() else { return };
    let fx = fixture();
    let cases = fx["cases"].as_array().expect("cases");
    assert!(cases.len() >= 40);
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        for (key, parse_special) in [("ids_special", true), ("ids_nospecial", false)] {
            let want = ids(&case[key]);
            let got = tok.encode(text, false, parse_special).expect("encode");
            if got != want {
                failures.push(format!(
                    "{text:?} ({key}):\n  want {want:?}\n  got  {got:?}"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn decode_round_trips_and_streams_whole_characters() {
    let Some(tok) = tokenizer() else { return };
    let fx = fixture();
    for case in fx["cases"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        for key in ["ids_special", "ids_nospecial"] {
            let ids = ids(&case[key]);
            assert_eq!(tok.decode(&ids, false), text, "decode {key} of {text:?}");
            let mut stream = tok.decode_stream(false);
            let mut streamed = String::new();
            for &id in &ids {
                if let Some(piece) = stream.step(&tok, id) {
                    streamed.push_str(piece);
                }
            }
            assert!(
                stream.finish().is_none(),
                "nothing held back at the end of {text:?}"
            );
            assert_eq!(streamed, text, "stream {key} of {text:?}");
        }
        // Our own encoding round-trips too.
        let ours = tok.encode(text, false, true).expect("encode");
        assert_eq!(tok.decode(&ours, false), text);
    }
}

#[test]
fn special_ids_match_the_gguf() {
    let Some(tok) = tokenizer() else { return };
    let fx = fixture();
    let meta = &fx["tokenizer"];
    assert_eq!(tok.vocab_size() as u64, meta["n_vocab"].as_u64().unwrap());
    assert_eq!(tok.bos_id().map(u64::from), meta["bos_id"].as_u64());
    assert_eq!(tok.eos_id().map(u64::from), meta["eos_id"].as_u64());
    assert!(!tok.adds_bos());
    assert_eq!(
        tok.encode("Hello world", true, true).unwrap(),
        ids(&meta["hello_world_add_bos_true"])
    );
    // EOS (`<|im_end|>`) first, then `<|endoftext|>`.
    assert_eq!(tok.eos_ids(), &[2, 0]);
    assert!(tok.is_eos(2) && !tok.is_eos(1));
    for pair in meta["control_tokens"].as_array().unwrap() {
        let id = pair[0].as_u64().unwrap() as u32;
        let text = pair[1].as_str().unwrap();
        assert_eq!(tok.token_kind(id), Some(TokenKind::Control), "{text}");
        assert_eq!(tok.token_id(text), Some(id));
        assert_eq!(tok.token_to_piece(id), Some(text.as_bytes()));
    }
    assert_eq!(tok.bos_token().as_deref(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token().as_deref(), Some("<|im_end|>"));
    assert!(
        tok.chat_template()
            .is_some_and(|t| t.contains("<|im_start|>"))
    );
    // skip_special drops control tokens.
    let ids = tok
        .encode("<|im_start|>user\nhi<|im_end|>", false, true)
        .unwrap();
    assert_eq!(tok.decode(&ids, true), "user\nhi");
    assert_eq!(tok.token_text(19556).as_deref(), Some("Hello"));
}

#[test]
fn long_and_pathological_inputs_encode() {
    let Some(tok) = tokenizer() else { return };
    for text in [
        " ".repeat(20_000),
        "\n".repeat(5000),
        "a".repeat(50_000),
        "1".repeat(3000),
        "😀".repeat(2000),
    ] {
        let ids = tok.encode(&text, false, false).expect("encode");
        assert_eq!(tok.decode(&ids, false), text);
    }
}
