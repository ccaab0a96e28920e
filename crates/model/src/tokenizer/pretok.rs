//! Pre-tokenizer split regexes for GGUF `gpt2` (byte-level BPE) vocabularies, keyed by
//! `tokenizer.ggml.pre` exactly as llama.cpp maps them (`llama-vocab.cpp`).
//!
//! Each entry is a list of regexes applied in sequence: every regex splits each piece left
//! by the previous one into matches and the text between them (HF `Split`, `Isolated`).

/// GPT-2's split regex.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's regex (digits in groups of up to three).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's regex: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's Tekken regex in llama.cpp's form: the case classes `\p{Lu}`/`\p{Ll}` become
/// look-aheads over `\p{L}`, so combining marks (`\p{M}`) count as punctuation, as there.
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-4o / Llama 4 (o200k) regex in llama.cpp's form (see [`TEKKEN`]).
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `gpt2` vocabulary splits text before BPE.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PreTokenizer {
    /// Regexes applied in sequence.
    pub regexes: &'static [&'static str],
    /// Whether a whole pre-token found in the vocabulary is taken as is, without merges
    /// (llama.cpp `ignore_merges`, HF `BPE.ignore_merges`).
    pub ignore_merges: bool,
}

impl PreTokenizer {
    const fn new(regexes: &'static [&'static str], ignore_merges: bool) -> Self {
        Self {
            regexes,
            ignore_merges,
        }
    }

    /// The pre-tokenizer llama.cpp uses for `pre`, or `None` if this table lacks it.
    pub(crate) fn for_pre(pre: &str) -> Option<Self> {
        Some(match pre {
            // llama.cpp's fallback when no `pre` is recorded.
            "default" => Self::new(
                &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
                false,
            ),
            "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" | "roberta-bpe"
            | "jina-es" | "jina-de" | "jina-v1-en" | "jina-v2-es" | "jina-v2-de"
            | "jina-v2-code" | "gigachat" => Self::new(&[GPT2], false),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => Self::new(&[r"\p{N}", GPT2], false),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" => Self::new(&[LLAMA3], true),
            "dbrx" | "smaug-bpe" => Self::new(&[LLAMA3], false),
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" => {
                Self::new(&[QWEN2], false)
            }
            "tekken" => Self::new(&[TEKKEN], true),
            "gpt-4o" | "llama4" => Self::new(&[GPT4O], false),
            "falcon" => Self::new(&[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"], false),
            _ => return None,
        })
    }

    /// GPT-2's pre-tokenizer, used for `pre` values this table does not know.
    pub(crate) fn gpt2() -> Self {
        Self::new(&[GPT2], false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_regex_compiles() {
        let names = [
            "default",
            "gpt2",
            "smollm",
            "llama-bpe",
            "dbrx",
            "qwen2",
            "tekken",
            "gpt-4o",
            "falcon",
        ];
        for name in names {
            let pre = PreTokenizer::for_pre(name).expect(name);
            for re in pre.regexes {
                assert!(fancy_regex_compiles(re), "{name}: {re}");
            }
        }
        assert!(PreTokenizer::for_pre("no-such-pre").is_none());
    }

    fn fancy_regex_compiles(re: &str) -> bool {
        tokenizers::pre_tokenizers::split::Split::new(
            tokenizers::pre_tokenizers::split::SplitPattern::Regex(re.into()),
            tokenizers::SplitDelimiterBehavior::Isolated,
            false,
        )
        .is_ok()
    }
}
