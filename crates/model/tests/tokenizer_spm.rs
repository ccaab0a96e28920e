//! SentencePiece (GGUF `llama` vocabulary) encoding on a small hand-built vocabulary, against
//! ids llama.cpp produced for the same vocabulary.
//!
//! The expected ids come from llama-cpp-python 0.3.36 (`Llama(path, vocab_only=True)`,
//! `tokenize(text, add_bos=False, special=...)`) on a GGUF holding exactly the vocabulary
//! [`vocab`] builds: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, scored pieces, single
//! characters, a user-defined `<|user|>` and a control `<|end|>`.

use turbokv_model::tokenizer::{GgufVocab, TokenKind, Tokenizer, TokenizerError};

const PIECES: &[&str] = &[
    "▁t",
    "▁a",
    "he",
    "in",
    "th",
    "er",
    "▁the",
    "on",
    "▁s",
    "ll",
    "▁w",
    "or",
    "▁h",
    "llo",
    "▁hello",
    "ld",
    "▁wor",
    "▁world",
    "ab",
    "bc",
    "abc",
    "▁ab",
    "an",
    "re",
    "▁th",
    "at",
    "en",
    "es",
    "is",
    "it",
    "▁c",
    "▁o",
    "▁i",
    "▁b",
    "▁f",
    "ing",
    "▁in",
    "▁an",
    "ed",
    "ou",
    "ar",
    "▁p",
    "▁m",
    "▁is",
    "▁it",
    "▁d",
    "ic",
    "al",
    "nd",
    "▁and",
    "▁to",
    "▁of",
    "le",
    "▁l",
    "st",
    "ro",
    "as",
    "ent",
    "ion",
    "▁re",
    "▁e",
    "▁n",
    "om",
    "▁g",
    "▁y",
    "▁you",
    "el",
    "▁1",
    "12",
    "▁12",
    "23",
    "日本",
    "▁日",
    "é",
    "▁é",
    "ét",
    "aa",
    "aaa",
    "▁▁",
    "▁▁▁▁",
    "\n\n",
];
const CHARS: &str = "▁etaoinshrdlcumwfgypbvkjxqz\nTHEWA1234567890.,!?'-日本語éü";

fn vocab(add_space_prefix: bool) -> GgufVocab {
    let mut toks: Vec<(String, i64, f32)> = vec![
        ("<unk>".into(), 2, 0.0),
        ("<s>".into(), 3, 0.0),
        ("</s>".into(), 3, 0.0),
    ];
    toks.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 6, 0.0)));
    toks.extend(
        PIECES
            .iter()
            .enumerate()
            .map(|(i, p)| (p.to_string(), 1, -(i as f32))),
    );
    toks.extend(
        CHARS
            .chars()
            .enumerate()
            .map(|(i, c)| (c.to_string(), 1, -1000.0 - i as f32)),
    );
    toks.push(("<|user|>".into(), 4, 0.0));
    toks.push(("<|end|>".into(), 3, 0.0));
    let mut seen = std::collections::HashSet::new();
    toks.retain(|t| seen.insert(t.0.clone()));
    assert_eq!(toks.len(), 395);
    GgufVocab {
        model: "llama".into(),
        tokens: toks.iter().map(|t| t.0.clone()).collect(),
        token_types: Some(toks.iter().map(|t| t.1).collect()),
        scores: Some(toks.iter().map(|t| t.2).collect()),
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        add_space_prefix: Some(add_space_prefix),
        ..GgufVocab::default()
    }
}

/// (text, ids with special parsing, ids without) from llama.cpp, `add_space_prefix` on.
const PREFIXED: &[(&str, &[u32], &[u32])] = &[
    ("hello world", &[340, 261, 272, 276], &[340, 261, 272, 276]),
    (
        "the abc and the ab",
        &[265, 260, 278, 308, 265, 280],
        &[265, 260, 278, 308, 265, 280],
    ),
    (" hello", &[337, 261, 272], &[337, 261, 272]),
    (
        "Hello  world\n\nx",
        &[340, 369, 341, 272, 340, 276, 339, 364],
        &[340, 369, 341, 272, 340, 276, 339, 364],
    ),
    (
        "日本語 é ét",
        &[340, 330, 391, 333, 333, 342],
        &[340, 330, 391, 333, 333, 342],
    ),
    (
        "<s>hi</s>",
        &[1, 271, 345, 2],
        &[340, 63, 347, 65, 348, 345, 63, 50, 347, 65],
    ),
    (
        "<|user|>it is<|end|>",
        &[393, 303, 302, 394],
        &[393, 303, 302, 63, 127, 285, 350, 127, 65],
    ),
    (
        "zzz✓Ω",
        &[340, 366, 366, 366, 229, 159, 150, 209, 172],
        &[340, 366, 366, 366, 229, 159, 150, 209, 172],
    ),
    ("aaaaaaa", &[260, 335, 335, 335], &[260, 335, 335, 335]),
    ("", &[], &[]),
    ("12 123", &[328, 328, 375], &[328, 328, 375]),
];

/// The same with `add_space_prefix` off.
const UNPREFIXED: &[(&str, &[u32], &[u32])] = &[
    ("hello world", &[261, 272, 276], &[261, 272, 276]),
    (
        "the abc and the ab",
        &[342, 261, 260, 278, 308, 265, 280],
        &[342, 261, 260, 278, 308, 265, 280],
    ),
    (" hello", &[340, 261, 272], &[340, 261, 272]),
    (
        "Hello  world\n\nx",
        &[369, 341, 272, 340, 276, 339, 364],
        &[369, 341, 272, 340, 276, 339, 364],
    ),
    (
        "日本語 é ét",
        &[330, 391, 333, 333, 342],
        &[330, 391, 333, 333, 342],
    ),
    (
        "<s>hi</s>",
        &[1, 348, 345, 2],
        &[63, 347, 65, 348, 345, 63, 50, 347, 65],
    ),
    (
        "<|user|>it is<|end|>",
        &[393, 288, 302, 394],
        &[393, 288, 302, 63, 127, 285, 350, 127, 65],
    ),
    (
        "zzz✓Ω",
        &[366, 366, 366, 229, 159, 150, 209, 172],
        &[366, 366, 366, 229, 159, 150, 209, 172],
    ),
    ("aaaaaaa", &[335, 335, 336], &[335, 335, 336]),
    ("", &[], &[]),
    ("12 123", &[327, 328, 375], &[327, 328, 375]),
];

#[test]
fn encodes_like_llama_cpp() {
    for (prefix, cases) in [(true, PREFIXED), (false, UNPREFIXED)] {
        let tok = Tokenizer::from_gguf_vocab(vocab(prefix)).expect("build");
        for &(text, special, plain) in cases {
            assert_eq!(
                tok.encode(text, false, true).unwrap(),
                special,
                "{text:?} special, prefix {prefix}"
            );
            assert_eq!(
                tok.encode(text, false, false).unwrap(),
                plain,
                "{text:?} plain, prefix {prefix}"
            );
        }
    }
}

#[test]
fn decodes_spaces_bytes_and_the_prefix() {
    let tok = Tokenizer::from_gguf_vocab(vocab(true)).expect("build");
    for text in [
        "hello world",
        " hello",
        "Hello  world\n\nx",
        "zzz✓Ω",
        "日本語 é ét",
        "aaaaaaa",
        "",
    ] {
        let ids = tok.encode(text, false, false).unwrap();
        assert_eq!(tok.decode(&ids, false), text, "{ids:?}");
    }
    // BOS is added by default for SentencePiece vocabularies, and skipped on request.
    let ids = tok.encode("hello", true, false).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids, true), "hello");
    assert_eq!(tok.decode(&ids, false), "<s> hello");
    // A stream keeps the space: generated text continues a prompt.
    let mut stream = tok.decode_stream(false);
    let got: String = [261u32, 272]
        .iter()
        .filter_map(|&id| stream.step(&tok, id).map(str::to_owned))
        .collect();
    assert_eq!(got, "hello");
    // Byte tokens of one character stream as one piece.
    let mut stream = tok.decode_stream(false);
    assert_eq!(stream.step(&tok, 229), None);
    assert_eq!(stream.step(&tok, 159), None);
    assert_eq!(stream.step(&tok, 150), Some("✓"));
    assert_eq!(stream.step(&tok, 229), None);
    assert_eq!(stream.finish(), Some("\u{FFFD}"));
}

#[test]
fn kinds_and_specials() {
    let tok = Tokenizer::from_gguf_vocab(vocab(true)).expect("build");
    assert_eq!(tok.token_kind(0), Some(TokenKind::Unknown));
    assert_eq!(tok.token_kind(1), Some(TokenKind::Control));
    assert_eq!(tok.token_kind(13), Some(TokenKind::Byte));
    assert_eq!(tok.token_kind(393), Some(TokenKind::UserDefined));
    assert_eq!(tok.token_to_piece(13), Some(&b"\n"[..]));
    assert_eq!(tok.token_to_piece(265), Some(&b" the"[..]));
    // `</s>` (EOS) and the control `<|end|>` end generation.
    assert_eq!(tok.eos_ids(), &[2, 394]);
    assert!(tok.adds_bos());
    assert_eq!(tok.vocab_size(), 395);
}

#[test]
fn bad_vocabularies_are_typed_errors() {
    let mut v = vocab(true);
    v.model = "bert".into();
    assert!(matches!(
        Tokenizer::from_gguf_vocab(v),
        Err(TokenizerError::UnsupportedModel { .. })
    ));
    let mut v = vocab(true);
    v.scores = None;
    let err = Tokenizer::from_gguf_vocab(v).unwrap_err();
    assert!(err.to_string().contains("scores"), "{err}");
    let mut v = vocab(true);
    v.token_types.as_mut().unwrap().pop();
    assert!(matches!(
        Tokenizer::from_gguf_vocab(v),
        Err(TokenizerError::InvalidVocab { .. })
    ));
    let mut v = vocab(true);
    v.eos_id = Some(10_000);
    assert!(
        Tokenizer::from_gguf_vocab(v)
            .unwrap_err()
            .to_string()
            .contains("outside")
    );
    let v = GgufVocab {
        model: "gpt2".into(),
        tokens: vec!["a".into()],
        ..GgufVocab::default()
    };
    assert!(
        Tokenizer::from_gguf_vocab(v)
            .unwrap_err()
            .to_string()
            .contains("merges")
    );
}
