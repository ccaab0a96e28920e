//! `turbokv serve --random-shape NAME`: a model of a real shape (`bench decode`'s shapes) with
//! random bf16 weights and a tokenizer made in memory, so that the server can be load-tested
//! on a machine without model files. A benchmarking aid: what it generates is noise.
//!
//! The tokenizer is byte-level with no merges: text encodes to one token per byte (ids 0–255
//! in GPT-2's byte order), every other id decodes to a word of its own (` t1234`), and the
//! last two ids are BOS and EOS. Clients that want an exact prompt length send token ids
//! (`/v1/completions` takes them).

use anyhow::{Context, Result, bail};
use turbokv_model::tokenizer::{GgufVocab, Tokenizer};
use turbokv_model::{Model, Transformer};

use crate::bench_decode::{BenchBackend, random_weights, shape_config};

/// Token type codes of a GGUF vocabulary (`tokenizer.ggml.token_type`).
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;

/// The random-weight model of shape `shape` on `backend`, and its stand-in tokenizer.
pub fn random_model<B: BenchBackend>(backend: B, shape: &str) -> Result<(Model<B>, Tokenizer)> {
    let (config, tied) = shape_config(shape)?;
    let tokenizer = synthetic_tokenizer(config.vocab_size)?;
    let (weights, weight_bytes) = random_weights(&backend, &config, tied, 1)
        .with_context(|| format!("random weights of shape {shape}"))?;
    let model = Model {
        transformer: Transformer::new(backend, config, weights),
        weight_bytes,
        gguf: None,
        name: format!("random-{shape}"),
    };
    Ok((model, tokenizer))
}

/// A byte-level tokenizer of `vocab` ids made without files (see the module docs).
pub fn synthetic_tokenizer(vocab: usize) -> Result<Tokenizer> {
    if vocab < 256 + 2 {
        bail!("a vocabulary of {vocab} ids has no room for 256 bytes, BOS and EOS");
    }
    let mut tokens: Vec<String> = byte_level_chars().iter().map(char::to_string).collect();
    // 'Ġ' is the byte-level form of a space.
    tokens.extend((256..vocab - 2).map(|id| format!("\u{120}t{id}")));
    tokens.push("<|begin_of_text|>".into());
    tokens.push("<|end_of_text|>".into());
    let mut types = vec![NORMAL; vocab];
    types[vocab - 2] = CONTROL;
    types[vocab - 1] = CONTROL;
    let v = GgufVocab {
        model: "gpt2".into(),
        pre: Some("gpt2".into()),
        tokens,
        token_types: Some(types),
        merges: Some(Vec::new()),
        bos_id: Some((vocab - 2) as u32),
        eos_id: Some((vocab - 1) as u32),
        add_bos: Some(false),
        ..GgufVocab::default()
    };
    Ok(Tokenizer::from_gguf_vocab(v)?)
}

/// GPT-2's byte-level alphabet: the character standing for each byte, in byte order
/// (printable bytes stand for themselves, the others for 256 + their rank among them).
fn byte_level_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_tokenizer_round_trips_text_and_decodes_every_id() {
        let t = synthetic_tokenizer(1000).unwrap();
        assert_eq!(t.vocab_size(), 1000);
        let text = "Hello, wörld!\n\tdef f(x): return x  # ok";
        let ids = t.encode(text, true, false).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte, no BOS");
        assert_eq!(ids[0], u32::from(b'H'), "a byte's id is the byte");
        assert_eq!(t.decode(&ids, true), text);
        assert_eq!(
            t.decode(&[300, 998, 301], true),
            " t300 t301",
            "BOS is skipped"
        );
        assert!(t.is_eos(999));
        assert_eq!(t.bos_id(), Some(998));
        for id in 0..998 {
            assert!(t.token_to_piece(id).is_some_and(|p| !p.is_empty()), "{id}");
        }
        assert!(synthetic_tokenizer(257).is_err());
    }

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let c = byte_level_chars();
        assert_eq!(c[b'A' as usize], 'A');
        assert_eq!(c[b' ' as usize], '\u{120}');
        assert_eq!(c[0], '\u{100}');
        assert_eq!(c[173], '\u{143}');
        let mut sorted = c.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }
}
