//! Tokenizers from GGUF metadata: `gpt2` (byte-level BPE with merges) and `llama`
//! (SentencePiece scores, rebuilt as BPE whose merge order follows the scores).

use std::collections::HashSet;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::pretok::PreTokenizer;
use super::vocab::{PieceTable, TextEncoding, TokenKind, parse_byte_token};
use super::{Parts, TokenizerError};
use crate::gguf::{MetaValue, Metadata};

/// The tokenizer fields of a GGUF file (`tokenizer.ggml.*`, `tokenizer.chat_template`), as
/// stored and not yet checked. Build one by hand to test with a small vocabulary.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` or `llama`.
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer name (`gpt2` vocabularies).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece: higher merges first).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte).
    pub token_types: Option<Vec<i64>>,
    /// `tokenizer.ggml.merges`, `"left right"`, highest priority first (`gpt2`).
    pub merges: Option<Vec<String>>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_id: Option<u32>,
    /// `tokenizer.ggml.eot_token_id` (end of turn).
    pub eot_id: Option<u32>,
    /// `tokenizer.ggml.eom_token_id` (end of message).
    pub eom_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token` (default: true for `llama`, false for `gpt2`).
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token` (default false).
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (default: true for `llama`, false for `gpt2`).
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

impl GgufVocab {
    /// Reads the tokenizer fields; a present key of the wrong type is an error.
    pub fn from_metadata(meta: &Metadata) -> Result<Self, TokenizerError> {
        let id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            meta.opt_u64(key)?
                .map(|v| {
                    u32::try_from(v).map_err(|_| invalid(format!("{key} = {v} is not a token id")))
                })
                .transpose()
        };
        let opt_array = |key: &str| meta.get(key).map(|_| meta.array(key)).transpose();
        Ok(Self {
            model: meta.str("tokenizer.ggml.model")?.to_owned(),
            pre: meta.opt_str("tokenizer.ggml.pre")?.map(str::to_owned),
            tokens: strings(
                meta.array("tokenizer.ggml.tokens")?,
                "tokenizer.ggml.tokens",
            )?,
            scores: opt_array("tokenizer.ggml.scores")?
                .map(|a| typed(a, "tokenizer.ggml.scores", |v| v.as_f64().map(|f| f as f32)))
                .transpose()?,
            token_types: opt_array("tokenizer.ggml.token_type")?
                .map(|a| typed(a, "tokenizer.ggml.token_type", MetaValue::as_i64))
                .transpose()?,
            merges: opt_array("tokenizer.ggml.merges")?
                .map(|a| strings(a, "tokenizer.ggml.merges"))
                .transpose()?,
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            eot_id: id("tokenizer.ggml.eot_token_id")?,
            eom_id: id("tokenizer.ggml.eom_token_id")?,
            add_bos: meta.opt_bool("tokenizer.ggml.add_bos_token")?,
            add_eos: meta.opt_bool("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: meta.opt_bool("tokenizer.ggml.add_space_prefix")?,
            chat_template: meta.opt_str("tokenizer.chat_template")?.map(str::to_owned),
        })
    }
}

fn invalid(what: String) -> TokenizerError {
    TokenizerError::InvalidVocab { what }
}

fn typed<T>(
    items: &[MetaValue],
    key: &str,
    f: impl Fn(&MetaValue) -> Option<T>,
) -> Result<Vec<T>, TokenizerError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| f(v).ok_or_else(|| invalid(format!("{key}[{i}] has the wrong type: {v:?}"))))
        .collect()
}

fn strings(items: &[MetaValue], key: &str) -> Result<Vec<String>, TokenizerError> {
    typed(items, key, |v| v.as_str().map(str::to_owned))
}

/// Which of the two GGUF vocabulary families a file uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// `gpt2`: byte-level BPE with explicit merges.
    Gpt2,
    /// `llama`: SentencePiece with scores.
    SentencePiece,
}

/// Checks the vocabulary and builds the tokenizer parts.
pub(super) fn build(v: GgufVocab) -> Result<Parts, TokenizerError> {
    let family = match v.model.as_str() {
        "gpt2" => Family::Gpt2,
        "llama" => Family::SentencePiece,
        other => {
            return Err(TokenizerError::UnsupportedModel {
                model: other.to_owned(),
            });
        }
    };
    let n = v.tokens.len();
    if n == 0 || u32::try_from(n).is_err() {
        return Err(invalid(format!("{n} tokens")));
    }
    let kinds = token_kinds(&v, n)?;
    for (name, id) in [
        ("bos", v.bos_id),
        ("eos", v.eos_id),
        ("unk", v.unk_id),
        ("eot", v.eot_id),
        ("eom", v.eom_id),
    ] {
        if let Some(id) = id
            && id as usize >= n
        {
            return Err(invalid(format!(
                "{name} id {id} is outside the {n}-token vocabulary"
            )));
        }
    }
    // Later duplicates win, as in llama.cpp's `token_to_id`.
    let vocab: Vocab = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();

    let (mut inner, encoding, strip_first_space) = match family {
        Family::Gpt2 => (gpt2_tokenizer(&v, vocab)?, TextEncoding::ByteLevel, false),
        Family::SentencePiece => {
            let prefix = v.add_space_prefix.unwrap_or(true);
            (
                spm_tokenizer(&v, &kinds, vocab, prefix)?,
                TextEncoding::SentencePiece,
                prefix,
            )
        }
    };
    add_special_tokens(&mut inner, &v.tokens, &kinds);
    let pieces = PieceTable::build(
        v.tokens
            .iter()
            .map(|t| Some(t.as_str()))
            .zip(kinds.iter().copied()),
        encoding,
    );
    Ok(Parts {
        inner,
        pieces,
        bos: v.bos_id,
        eos: v.eos_id,
        extra_eog: v.eot_id.into_iter().chain(v.eom_id).collect(),
        add_bos: v.add_bos.unwrap_or(family == Family::SentencePiece),
        add_eos: v.add_eos.unwrap_or(false),
        strip_first_space,
        chat_template: v.chat_template,
    })
}

/// Token kinds from `token_type`; without it, BOS/EOS/UNK are control/unknown and the
/// rest normal (SentencePiece `<0xAB>` strings count as byte tokens).
fn token_kinds(v: &GgufVocab, n: usize) -> Result<Vec<TokenKind>, TokenizerError> {
    if let Some(types) = &v.token_types {
        if types.len() != n {
            return Err(invalid(format!(
                "token_type has {} entries for {n} tokens",
                types.len()
            )));
        }
        return Ok(types.iter().map(|&t| TokenKind::from_gguf(t)).collect());
    }
    let mut kinds: Vec<TokenKind> = v
        .tokens
        .iter()
        .map(|t| match v.model.as_str() {
            "llama" if parse_byte_token(t).is_some() => TokenKind::Byte,
            _ => TokenKind::Normal,
        })
        .collect();
    for id in [v.bos_id, v.eos_id].into_iter().flatten() {
        kinds[id as usize] = TokenKind::Control;
    }
    if let Some(id) = v.unk_id {
        kinds[id as usize] = TokenKind::Unknown;
    }
    Ok(kinds)
}

fn split_pretokenizer(re: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    Split::new(
        SplitPattern::Regex(re.to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map(PreTokenizerWrapper::Split)
    .map_err(|e| invalid(format!("pre-tokenizer regex {re:?}: {e}")))
}

/// Byte-level BPE with the split regexes llama.cpp uses for `tokenizer.ggml.pre`.
fn gpt2_tokenizer(v: &GgufVocab, vocab: Vocab) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let pre_name = v.pre.as_deref().unwrap_or("default");
    let pre = PreTokenizer::for_pre(pre_name).unwrap_or_else(|| {
        tracing::warn!(
            pre = pre_name,
            "unknown tokenizer.ggml.pre; using the GPT-2 pre-tokenizer"
        );
        PreTokenizer::gpt2()
    });
    let raw = v
        .merges
        .as_deref()
        .ok_or_else(|| invalid("gpt2 vocabulary without tokenizer.ggml.merges".into()))?;
    let mut merges = Vec::with_capacity(raw.len());
    let mut dropped = 0usize;
    for m in raw {
        // llama.cpp splits at the first space after the first byte.
        let cut = m
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == ' ')
            .map(|(i, _)| i);
        let Some((a, b)) = cut.map(|i| (&m[..i], &m[i + 1..])) else {
            return Err(invalid(format!("merge {m:?} has no space")));
        };
        let merged = format!("{a}{b}");
        if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&merged) {
            merges.push((a.to_owned(), b.to_owned()));
        } else {
            dropped += 1;
        }
    }
    if dropped > 0 {
        tracing::warn!(
            dropped,
            "merges naming tokens outside the vocabulary were ignored"
        );
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(|e| invalid(format!("BPE: {e}")))?;
    let mut steps = pre
        .regexes
        .iter()
        .map(|re| split_pretokenizer(re))
        .collect::<Result<Vec<_>, _>>()?;
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    )));
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(
        tokenizers::pre_tokenizers::sequence::Sequence::new(steps),
    )));
    tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    ))));
    Ok(tk)
}

/// SentencePiece as llama.cpp runs it: spaces become `▁` (one prefixed when
/// `add_space_prefix`), then adjacent symbols merge greedily, highest-scoring result first
/// (leftmost on ties), and characters left outside the vocabulary fall back to `<0xAB>`.
///
/// That is BPE whose merges are every split of a vocabulary piece into two pieces, ranked by
/// the merged piece's score. Limits: merges of equal score rank by token id instead of
/// position, and characters missing from the vocabulary cannot take part in merges.
fn spm_tokenizer(
    v: &GgufVocab,
    kinds: &[TokenKind],
    vocab: Vocab,
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let scores = v
        .scores
        .as_deref()
        .ok_or_else(|| invalid("llama vocabulary without tokenizer.ggml.scores".into()))?;
    if scores.len() != v.tokens.len() {
        return Err(invalid(format!(
            "scores has {} entries for {} tokens",
            scores.len(),
            v.tokens.len()
        )));
    }
    let merges = spm_merges(&v.tokens, scores, kinds, &vocab);
    let has_bytes = kinds.contains(&TokenKind::Byte);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(has_bytes);
    if let Some(unk) = v.unk_id {
        builder = builder.unk_token(v.tokens[unk as usize].clone());
    }
    let bpe = builder
        .build()
        .map_err(|e| invalid(format!("SentencePiece BPE: {e}")))?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let replace = Replace::new(" ", "▁").map_err(|e| invalid(format!("normalizer: {e}")))?;
    let normalizer = if add_space_prefix {
        NormalizerWrapper::Sequence(tokenizers::normalizers::Sequence::new(vec![
            NormalizerWrapper::Prepend(Prepend::new("▁".into())),
            NormalizerWrapper::Replace(replace),
        ]))
    } else {
        NormalizerWrapper::Replace(replace)
    };
    tk.with_normalizer(Some(normalizer));
    Ok(tk)
}

/// Every (left, right) split of a normal piece into two vocabulary pieces, best merged
/// score first.
fn spm_merges(
    tokens: &[String],
    scores: &[f32],
    kinds: &[TokenKind],
    vocab: &Vocab,
) -> Vec<(String, String)> {
    let mergeable = |s: &str| {
        vocab.get(s).is_some_and(|&id| {
            matches!(
                kinds[id as usize],
                TokenKind::Normal | TokenKind::UserDefined
            )
        })
    };
    let mut found: Vec<(f32, u32, usize)> = Vec::new(); // (score, merged id, split byte)
    for (id, text) in tokens.iter().enumerate() {
        if !matches!(kinds[id], TokenKind::Normal | TokenKind::UserDefined)
            || vocab.get(text.as_str()) != Some(&(id as u32))
        {
            continue;
        }
        for (cut, _) in text.char_indices().skip(1) {
            if mergeable(&text[..cut]) && mergeable(&text[cut..]) {
                found.push((scores[id], id as u32, cut));
            }
        }
    }
    // Stable: equal scores keep id order.
    found.sort_by(|a, b| b.0.total_cmp(&a.0));
    found
        .into_iter()
        .map(|(_, id, cut)| {
            let t = &tokens[id as usize];
            (t[..cut].to_owned(), t[cut..].to_owned())
        })
        .collect()
}

/// Control and unknown tokens become special added tokens (recognised in text only with
/// special parsing); user-defined tokens become ordinary added tokens (always recognised).
fn add_special_tokens(tk: &mut tokenizers::Tokenizer, tokens: &[String], kinds: &[TokenKind]) {
    let mut special = Vec::new();
    let mut user = Vec::new();
    let mut seen = HashSet::new();
    for (text, kind) in tokens.iter().zip(kinds) {
        let is_special = match kind {
            TokenKind::Control | TokenKind::Unknown => true,
            TokenKind::UserDefined => false,
            _ => continue,
        };
        if text.is_empty() || !seen.insert(text.as_str()) {
            continue;
        }
        let token = AddedToken::from(text.clone(), is_special).normalized(false);
        if is_special {
            special.push(token)
        } else {
            user.push(token)
        }
    }
    tk.add_special_tokens(&special);
    tk.add_tokens(&user);
}
