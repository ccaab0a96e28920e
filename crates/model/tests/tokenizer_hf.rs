//! Hugging Face tokenizer directories, written by the test: a byte-level BPE one (checked
//! against the same vocabulary loaded as a GGUF `gpt2` vocabulary) and a SentencePiece-style
//! one with byte fallback and a BOS-adding post-processor.

use std::path::PathBuf;

use serde_json::{Value, json};
use turbokv_model::tokenizer::{GgufVocab, TokenKind, Tokenizer};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("turbokv-tokenizer-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn write(dir: &std::path::Path, file: &str, v: &Value) {
    std::fs::write(dir.join(file), serde_json::to_string_pretty(v).unwrap()).expect("write");
}

/// GPT-2's byte → char table.
fn byte_chars() -> Vec<char> {
    let mut shifted = 0;
    (0u32..256)
        .map(|b| {
            if matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF) {
                char::from_u32(b).unwrap()
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap()
            }
        })
        .collect()
}

const SPECIALS: &[(&str, bool)] = &[
    ("<|endoftext|>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<tool>", false),
];
const MERGES: &[&str] = &[
    "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ Ġ", "1 2",
];

/// Tokens: the specials, the 256 byte chars, then each merge result.
fn tokens() -> Vec<String> {
    let mut t: Vec<String> = SPECIALS.iter().map(|s| s.0.to_string()).collect();
    t.extend(byte_chars().iter().map(|c| c.to_string()));
    t.extend(MERGES.iter().map(|m| m.replace(' ', "")));
    t
}

fn byte_level_dir() -> PathBuf {
    let dir = temp_dir("bytelevel");
    let toks = tokens();
    let vocab: serde_json::Map<String, Value> = toks
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, (c, special))| {
            json!({"id": i, "content": c, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": special})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    write(
        &dir,
        "tokenizer.json",
        &json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": MERGES}
        }),
    );
    write(
        &dir,
        "tokenizer_config.json",
        &json!({
            "bos_token": null, "eos_token": {"content": "<|im_end|>", "special": true}, "add_bos_token": false,
            "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "CHAT"}]
        }),
    );
    write(
        &dir,
        "generation_config.json",
        &json!({"eos_token_id": [2, 0]}),
    );
    dir
}

#[test]
fn byte_level_directory_matches_the_gguf_path() {
    let dir = byte_level_dir();
    let hf = Tokenizer::from_hf_dir(&dir).expect("load");
    let toks = tokens();
    let types = toks
        .iter()
        .enumerate()
        .map(|(i, _)| match SPECIALS.get(i) {
            Some((_, true)) => 3,
            Some((_, false)) => 4,
            None => 1,
        })
        .collect();
    let gguf = Tokenizer::from_gguf_vocab(GgufVocab {
        model: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens: toks,
        token_types: Some(types),
        merges: Some(MERGES.iter().map(|m| m.to_string()).collect()),
        eos_id: Some(2),
        ..GgufVocab::default()
    })
    .expect("gguf");
    let hello = hf.token_id("hello").unwrap();
    let world = hf.token_id("Ġworld").unwrap();
    assert_eq!(
        hf.encode("hello world", true, true).unwrap(),
        [hello, world]
    );
    for text in [
        "hello world",
        "  hello   world\n\n",
        "<|im_start|>hello<|im_end|><tool>",
        "1234 héllo 😀",
        "it's <|endoftext|>",
        "",
    ] {
        for special in [true, false] {
            let ids = hf.encode(text, false, special).unwrap();
            assert_eq!(
                ids,
                gguf.encode(text, false, special).unwrap(),
                "{text:?} special={special}"
            );
            assert_eq!(hf.decode(&ids, false), text);
        }
    }
    // `<tool>` is user-defined: parsed even without special parsing.
    assert_eq!(hf.encode("<tool>", false, false).unwrap(), [3]);
    assert_eq!(hf.token_kind(3), Some(TokenKind::UserDefined));
    assert_eq!(hf.token_kind(1), Some(TokenKind::Control));
    assert_eq!(
        hf.decode(
            &hf.encode("<|im_start|>hi<|im_end|>", false, true).unwrap(),
            true
        ),
        "hi"
    );
    assert_eq!(hf.eos_ids(), &[2, 0]);
    assert_eq!(hf.bos_id(), None);
    assert_eq!(hf.chat_template(), Some("CHAT"));
    assert_eq!(hf.vocab_size(), gguf.vocab_size());

    // chat_template.jinja takes precedence over tokenizer_config.json.
    std::fs::write(dir.join("chat_template.jinja"), "FROM FILE").unwrap();
    assert_eq!(
        Tokenizer::from_hf_dir(&dir).unwrap().chat_template(),
        Some("FROM FILE")
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn sentencepiece_directory_adds_bos_and_strips_the_prefix_space() {
    let dir = temp_dir("spm");
    let vocab = json!({"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "▁": 4, "h": 5, "i": 6, "▁h": 7, "▁hi": 8});
    let special = |id: u32, c: &str| {
        json!({"id": id, "content": c, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    write(
        &dir,
        "tokenizer.json",
        &json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null,
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": ["▁ h", "▁h i"]}
        }),
    );
    write(
        &dir,
        "tokenizer_config.json",
        &json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": "X"}),
    );
    let tok = Tokenizer::from_hf_dir(&dir).expect("load");
    assert!(tok.adds_bos(), "probed from the post-processor");
    let ids = tok.encode("hi\n", true, false).unwrap();
    assert_eq!(ids, [1, 8, 3]);
    assert_eq!(tok.decode(&ids, true), "hi\n");
    assert_eq!(tok.token_kind(3), Some(TokenKind::Byte));
    assert_eq!(tok.bos_token().as_deref(), Some("<s>"));
    assert_eq!(tok.eos_ids(), &[2]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn missing_or_broken_files_are_errors() {
    let dir = temp_dir("broken");
    let err = Tokenizer::from_hf_dir(&dir).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    std::fs::write(dir.join("tokenizer.json"), "{not json").unwrap();
    let err = Tokenizer::from_hf_dir(&dir).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn public_types_can_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Tokenizer>();
    send_sync::<turbokv_model::tokenizer::DecodeStream>();
    send_sync::<turbokv_model::chat::ChatTemplate>();
    send_sync::<turbokv_model::sampling::Sampler>();
    send_sync::<turbokv_model::sampling::StopChecker>();
}
