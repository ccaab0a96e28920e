//! Hugging Face tokenizer directories: `tokenizer.json` (+ `tokenizer_config.json`,
//! `chat_template.jinja`, `generation_config.json`).

use std::path::Path;

use serde_json::Value;

use super::vocab::{PieceTable, TextEncoding, TokenKind, parse_byte_token};
use super::{Parts, TokenizerError};

fn read(path: &Path) -> Result<Option<String>, TokenizerError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

fn parse_json(path: &Path, text: &str) -> Result<Value, TokenizerError> {
    serde_json::from_str(text).map_err(|e| TokenizerError::Parse {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    read(path)?.map(|t| parse_json(path, &t)).transpose()
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_string(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

/// `eos_token_id` in `generation_config.json`: an id or a list of ids.
fn id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

/// `chat_template` in `tokenizer_config.json`: a string, or named templates (the one
/// called `default`, else the first).
fn config_template(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            };
            named("default")
                .or(list.first())?
                .get("template")?
                .as_str()
                .map(str::to_owned)
        }
        _ => None,
    }
}

/// The decoder's steps, with `Sequence`s flattened.
fn decoder_steps(v: Option<&Value>, out: &mut Vec<Value>) {
    let Some(v) = v else { return };
    match v.get("type").and_then(Value::as_str) {
        Some("Sequence") => {
            for d in v
                .get("decoders")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                decoder_steps(Some(d), out);
            }
        }
        Some(_) => out.push(v.clone()),
        None => {}
    }
}

/// How the decoder turns token strings into text: the encoding, whether `<0xAB>` tokens are
/// bytes, and whether one leading space is stripped.
fn decoder_style(json: &Value) -> (TextEncoding, bool, bool) {
    let mut steps = Vec::new();
    decoder_steps(json.get("decoder"), &mut steps);
    let ty = |s: &Value| {
        s.get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let has = |name: &str| steps.iter().any(|s| ty(s) == name);
    let byte_fallback = has("ByteFallback")
        || json
            .pointer("/model/byte_fallback")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    let strip = steps.iter().any(|s| {
        (ty(s) == "Strip" && s.get("start").and_then(Value::as_u64).unwrap_or(0) > 0)
            || (ty(s) == "Metaspace"
                && (s
                    .get("add_prefix_space")
                    .and_then(Value::as_bool)
                    .unwrap_or(false)
                    || matches!(
                        s.get("prepend_scheme").and_then(Value::as_str),
                        Some("first" | "always")
                    )))
    });
    let replaces_space_marker = steps.iter().any(|s| {
        ty(s) == "Replace" && s.pointer("/pattern/String").and_then(Value::as_str) == Some("▁")
    });
    let encoding = if has("ByteLevel") {
        TextEncoding::ByteLevel
    } else if has("Metaspace") || replaces_space_marker {
        TextEncoding::SentencePiece
    } else {
        if !steps.is_empty() {
            tracing::warn!(
                "tokenizer.json decoder is neither byte-level nor SentencePiece; tokens decode as written"
            );
        }
        TextEncoding::Plain
    };
    (encoding, byte_fallback, strip)
}

pub(super) fn load(dir: &Path) -> Result<Parts, TokenizerError> {
    let tok_path = dir.join("tokenizer.json");
    let text = read(&tok_path)?.ok_or_else(|| TokenizerError::Io {
        path: tok_path.display().to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no tokenizer.json in the directory",
        ),
    })?;
    let json = parse_json(&tok_path, &text)?;
    let inner =
        tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| TokenizerError::Parse {
            path: tok_path.display().to_string(),
            message: e.to_string(),
        })?;
    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let generation = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);

    let (encoding, byte_fallback, strip_first_space) = decoder_style(&json);
    let added = inner.get_added_tokens_decoder();
    let n = inner
        .get_vocab(true)
        .values()
        .copied()
        .max()
        .map_or(0, |m| m as usize + 1);
    let texts: Vec<Option<String>> = (0..n as u32).map(|id| inner.id_to_token(id)).collect();
    let kinds: Vec<TokenKind> = (0..n as u32)
        .map(|id| match (added.get(&id), &texts[id as usize]) {
            (Some(t), _) if t.special => TokenKind::Control,
            (Some(_), _) => TokenKind::UserDefined,
            (None, None) => TokenKind::Unused,
            (None, Some(t)) if byte_fallback && parse_byte_token(t).is_some() => TokenKind::Byte,
            (None, Some(_)) => TokenKind::Normal,
        })
        .collect();
    let pieces = PieceTable::build(
        texts
            .iter()
            .map(|t| t.as_deref())
            .zip(kinds.iter().copied()),
        encoding,
    );

    let lookup = |key: &str| token_string(config.get(key)).and_then(|t| inner.token_to_id(t));
    let gen_bos = id_list(generation.get("bos_token_id")).first().copied();
    let bos = lookup("bos_token").or(gen_bos);
    let gen_eos = id_list(generation.get("eos_token_id"));
    let eos = lookup("eos_token").or(gen_eos.first().copied());
    let add_bos = match config.get("add_bos_token").and_then(Value::as_bool) {
        Some(b) => b,
        // No explicit flag: does the post-processor put BOS first?
        None => bos.is_some_and(|b| {
            inner
                .encode_fast("a", true)
                .is_ok_and(|e| e.get_ids().first() == Some(&b))
        }),
    };
    let add_eos = config
        .get("add_eos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let chat_template = match read(&dir.join("chat_template.jinja"))? {
        Some(t) => Some(t),
        None => config_template(config.get("chat_template")),
    };
    Ok(Parts {
        inner,
        pieces,
        bos,
        eos,
        extra_eog: gen_eos
            .into_iter()
            .filter(|&id| (id as usize) < n)
            .collect(),
        add_bos,
        add_eos,
        strip_first_space,
        chat_template,
    })
}
