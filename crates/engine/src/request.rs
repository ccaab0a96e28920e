//! What a client asks the engine for and what it gets back.

use turbokv_model::sampling::SamplingParams;

/// Identifies a request inside the engine.
pub type RequestId = u64;

/// One generation request: token ids in, a stream of [`Event`]s out.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// The prompt's token ids (template applied, BOS included when the model wants it).
    pub prompt: Vec<u32>,
    /// Temperature, top-k/p, min-p, repetition penalty, seed, max tokens, stop strings.
    pub sampling: SamplingParams,
    /// OpenAI's frequency penalty: subtracted from a token's logit once per time it was
    /// generated, in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// OpenAI's presence penalty: subtracted once from the logit of every generated token,
    /// in `[-2, 2]`.
    pub presence_penalty: f32,
    /// Log-probabilities of each chosen token plus this many alternatives (`None`: none).
    pub logprobs: Option<usize>,
    /// Keep generating past the end-of-sequence token (load tests).
    pub ignore_eos: bool,
}

impl GenerateRequest {
    /// A greedy request for `max_tokens` tokens.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            sampling: SamplingParams {
                max_tokens,
                ..SamplingParams::greedy()
            },
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logprobs: None,
            ignore_eos: false,
        }
    }
}

/// The log-probability of a chosen token and of the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The chosen token.
    pub token: u32,
    /// Its natural-log probability under the model (before penalties and filters).
    pub logprob: f32,
    /// The most likely tokens with theirs, best first.
    pub top: Vec<(u32, f32)>,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
}

impl FinishReason {
    /// OpenAI's name: `stop` or `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (an end-of-sequence token included).
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at admission.
    pub cached_tokens: usize,
}

/// What the engine sends back for a request, in order: tokens, then one `Finished` or
/// `Failed`.
#[derive(Clone, Debug)]
pub enum Event {
    /// A generated token and the text it completes (may be empty: held back for a possible
    /// stop string or an incomplete UTF-8 sequence).
    Token {
        /// The token id.
        id: u32,
        /// Text released with it.
        text: String,
        /// Its log-probabilities, when asked for.
        logprob: Option<TokenLogprob>,
    },
    /// The end.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Counts.
        usage: Usage,
        /// Text held back until the end (released now).
        tail: String,
    },
    /// The request could not be served.
    Failed(crate::EngineError),
}
