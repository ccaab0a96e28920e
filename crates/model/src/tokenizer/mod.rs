//! Tokenizer: GGUF vocabularies (`gpt2` byte-level BPE, `llama` SentencePiece) and Hugging
//! Face `tokenizer.json` directories behind one type that encodes, decodes and streams.
//!
//! Encoding goes through the `tokenizers` crate, set up to reproduce llama.cpp: the
//! pre-tokenizer regexes of each `tokenizer.ggml.pre` value, control tokens recognised only
//! when special parsing is asked for, user-defined tokens always. Decoding uses a table of
//! the bytes each token stands for, so a token sequence decodes in one pass and a stream
//! can hold back an incomplete UTF-8 sequence until its last byte arrives.

mod gguf;
mod hf;
mod pretok;
mod stream;
mod vocab;

pub use gguf::GgufVocab;
pub use stream::DecodeStream;
pub use vocab::TokenKind;

use vocab::PieceTable;

/// Errors building or running a tokenizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A GGUF tokenizer key is missing or of the wrong type.
    #[error("GGUF tokenizer metadata: {0}")]
    Gguf(#[from] crate::gguf::GgufError),
    /// The vocabulary type is not one this tokenizer implements.
    #[error("tokenizer model `{model}` is not supported (supported: gpt2, llama)")]
    UnsupportedModel {
        /// The `tokenizer.ggml.model` value.
        model: String,
    },
    /// The vocabulary is inconsistent (lengths, ids, merges).
    #[error("invalid tokenizer vocabulary: {what}")]
    InvalidVocab {
        /// What is wrong.
        what: String,
    },
    /// A tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A tokenizer file is not valid JSON or not a tokenizer the `tokenizers` crate accepts.
    #[error("cannot load {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
    /// The `tokenizers` pipeline failed on an input (e.g. a regex hit its backtracking limit).
    #[error("cannot encode text: {message}")]
    Encode {
        /// The pipeline's message.
        message: String,
    },
}

/// Token strings that end a turn or a document in common chat formats; those present in a
/// vocabulary as control tokens join [`Tokenizer::eos_ids`].
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "<|END_OF_TURN_TOKEN|>",
    "<｜end▁of▁sentence｜>",
    "</s>",
];

/// A text tokenizer with llama.cpp-compatible encoding and UTF-8-safe streaming decoding.
///
/// Invariant: both inner tokenizers share one vocabulary; `pieces` covers every id either
/// can produce; `eog` holds `eos` first when there is one, without duplicates.
#[derive(Clone)]
pub struct Tokenizer {
    /// Recognises control tokens written in the text.
    special: tokenizers::Tokenizer,
    /// The same pipeline with control tokens treated as plain text.
    plain: tokenizers::Tokenizer,
    pieces: PieceTable,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// SentencePiece with `add_space_prefix`: decoding drops the prefix space again.
    strip_first_space: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos_ids", &self.eog)
            .field("add_bos", &self.add_bos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

/// Everything a loader has worked out, before the two inner tokenizers are made.
pub(crate) struct Parts {
    pub inner: tokenizers::Tokenizer,
    pub pieces: PieceTable,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Extra end-of-generation ids beyond `eos` and the [`END_OF_TURN`] names.
    pub extra_eog: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub strip_first_space: bool,
    pub chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer of a GGUF model from its metadata.
    pub fn from_gguf(meta: &crate::gguf::Metadata) -> Result<Self, TokenizerError> {
        Self::from_gguf_vocab(GgufVocab::from_metadata(meta)?)
    }

    /// Builds a tokenizer from GGUF vocabulary fields (e.g. a hand-made vocabulary).
    pub fn from_gguf_vocab(vocab: GgufVocab) -> Result<Self, TokenizerError> {
        Ok(Self::assemble(gguf::build(vocab)?))
    }

    /// Loads a Hugging Face tokenizer directory: `tokenizer.json`, plus
    /// `tokenizer_config.json` (BOS/EOS, `add_bos_token`, `chat_template`),
    /// `chat_template.jinja` and `generation_config.json` (extra EOS ids) when present.
    pub fn from_hf_dir(dir: &std::path::Path) -> Result<Self, TokenizerError> {
        Ok(Self::assemble(hf::load(dir)?))
    }

    fn assemble(parts: Parts) -> Self {
        let mut eog: Vec<u32> = Vec::new();
        let mut push = |id: u32| {
            if !eog.contains(&id) {
                eog.push(id);
            }
        };
        parts
            .eos
            .into_iter()
            .chain(parts.extra_eog.iter().copied())
            .for_each(&mut push);
        for name in END_OF_TURN {
            if let Some(id) = parts.inner.token_to_id(name)
                && parts.pieces.kind(id) == Some(TokenKind::Control)
            {
                push(id);
            }
        }
        let mut plain = parts.inner.clone();
        plain.set_encode_special_tokens(true);
        Self {
            special: parts.inner,
            plain,
            pieces: parts.pieces,
            bos: parts.bos,
            eos: parts.eos,
            eog,
            add_bos: parts.add_bos,
            add_eos: parts.add_eos,
            strip_first_space: parts.strip_first_space,
            chat_template: parts.chat_template,
        }
    }

    /// Encodes `text`.
    ///
    /// `add_special` adds BOS (and EOS) where the model's tokenizer adds them;
    /// `parse_special` makes control tokens written in the text (`<|im_start|>`) single
    /// tokens; without it they are tokenized as ordinary text. User-defined tokens are
    /// always recognised, as in llama.cpp.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let inner = if parse_special {
            &self.special
        } else {
            &self.plain
        };
        let enc = inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode {
                message: e.to_string(),
            })?;
        let ids = enc.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        out.extend_from_slice(ids);
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// Decodes a whole sequence. `skip_special` leaves out control and unknown tokens.
    /// Ids outside the vocabulary decode to nothing; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let start = bytes.len();
            self.pieces.push_piece(id, skip_special, &mut bytes);
            // Undo the space the encoder prefixed to the text (SentencePiece only).
            if start == 0
                && self.strip_first_space
                && bytes.first() == Some(&b' ')
                && self.pieces.kind(id) == Some(TokenKind::Normal)
            {
                bytes.remove(0);
            }
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// A streaming decoder for generated tokens; see [`DecodeStream`].
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(skip_special)
    }

    /// The BOS token, if the vocabulary has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The EOS token, if the vocabulary has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Every token that ends generation: EOS first, then end-of-turn tokens such as
    /// `<|im_end|>` / `<|eot_id|>` and extra EOS ids from `generation_config.json`.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Number of token ids (the logits width the vocabulary needs).
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    /// The bytes `id` contributes to decoded text (control tokens: their text), or `None`
    /// for an id outside the vocabulary. May be part of a UTF-8 sequence.
    pub fn token_to_piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.piece(id)
    }

    /// The vocabulary string of `id` as stored (e.g. `Ġthe`, `▁the`, `<|im_end|>`).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.special.id_to_token(id)
    }

    /// The id of a vocabulary string (e.g. `"<|im_end|>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.special.token_to_id(text)
    }

    /// What kind of token `id` is, or `None` outside the vocabulary.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.pieces.kind(id)
    }

    /// The model's Jinja chat template, if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The BOS token's text (`<s>`, `<|begin_of_text|>`), for chat templates.
    pub fn bos_token(&self) -> Option<String> {
        self.bos.and_then(|id| self.token_text(id))
    }

    /// The EOS token's text, for chat templates.
    pub fn eos_token(&self) -> Option<String> {
        self.eos.and_then(|id| self.token_text(id))
    }

    pub(crate) fn pieces(&self) -> &PieceTable {
        &self.pieces
    }
}
