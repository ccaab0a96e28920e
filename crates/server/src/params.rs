//! Validation of OpenAI request bodies into engine requests. Every field is checked, with the
//! parameter named in the error; unknown fields are ignored (clients send extras).

use serde_json::{Map, Value};
use turbokv_engine::GenerateRequest;
use turbokv_model::sampling::SamplingParams;

use crate::error::ApiError;

/// What the two endpoints share, parsed from a body.
pub struct Common {
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// Reads typed fields of a JSON object.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub fn f32_in(&self, name: &str, lo: f32, hi: f32, default: f32) -> Result<f32, ApiError> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => {
                let x = v.as_f64().ok_or_else(|| {
                    ApiError::bad_param(name, format!("`{name}` must be a number"))
                })? as f32;
                if !(lo..=hi).contains(&x) {
                    return Err(ApiError::bad_param(
                        name,
                        format!("`{name}` must be between {lo} and {hi}, got {x}"),
                    ));
                }
                Ok(x)
            }
        }
    }

    pub fn int(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| ApiError::bad_param(name, format!("`{name}` must be an integer"))),
        }
    }

    pub fn uint(&self, name: &str) -> Result<Option<u64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                ApiError::bad_param(name, format!("`{name}` must be a non-negative integer"))
            }),
        }
    }

    pub fn bool(&self, name: &str) -> Result<bool, ApiError> {
        match self.get(name) {
            None => Ok(false),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ApiError::bad_param(name, format!("`{name}` must be a boolean"))),
        }
    }

    pub fn string(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| ApiError::bad_param(name, format!("`{name}` must be a string"))),
        }
    }
}

/// The fields every completion request has.
pub fn common(f: &Fields<'_>, max_tokens_names: &[&str]) -> Result<Common, ApiError> {
    let mut max_tokens = None;
    for name in max_tokens_names {
        if let Some(n) = f.int(name)? {
            if n < 1 {
                return Err(ApiError::bad_param(
                    name,
                    format!("`{name}` must be at least 1, got {n}"),
                ));
            }
            max_tokens = Some(n as usize);
        }
    }
    if let Some(n) = f.int("n")?
        && n != 1
    {
        return Err(ApiError::bad_param("n", "only `n` = 1 is supported"));
    }
    let temperature = f.f32_in("temperature", 0.0, 2.0, 1.0)?;
    let top_p = f.f32_in("top_p", 0.0, 1.0, 1.0)?;
    if top_p == 0.0 {
        return Err(ApiError::bad_param(
            "top_p",
            "`top_p` must be greater than 0",
        ));
    }
    let top_k = match f.int("top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::bad_param(
                "top_k",
                format!("`top_k` must be -1 (off) or positive, got {k}"),
            ));
        }
    };
    let min_p = f.f32_in("min_p", 0.0, 1.0, 0.0)?;
    let repetition_penalty = f.f32_in("repetition_penalty", 0.0, 10.0, 1.0)?;
    if repetition_penalty == 0.0 {
        return Err(ApiError::bad_param(
            "repetition_penalty",
            "`repetition_penalty` must be greater than 0",
        ));
    }
    let seed = f.int("seed")?.map(|s| s as u64);
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > 4 {
                return Err(ApiError::bad_param("stop", "at most 4 stop sequences"));
            }
            a.iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::bad_param(
                            "stop",
                            "`stop` must be a string or an array of strings",
                        )
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "stop",
                "`stop` must be a string or an array of strings",
            ));
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad_param(
            "stop",
            "stop sequences must not be empty",
        ));
    }
    let stream = f.bool("stream")?;
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::bad_param(
                    "stream_options",
                    "`stream_options` needs `stream`: true",
                ));
            }
            Fields(o).bool("include_usage")?
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "stream_options",
                "`stream_options` must be an object",
            ));
        }
    };
    Ok(Common {
        sampling: SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            seed,
            stop,
            ..SamplingParams::default()
        },
        max_tokens,
        frequency_penalty: f.f32_in("frequency_penalty", -2.0, 2.0, 0.0)?,
        presence_penalty: f.f32_in("presence_penalty", -2.0, 2.0, 0.0)?,
        stream,
        include_usage,
        ignore_eos: f.bool("ignore_eos")?,
    })
}

/// The engine request for a prompt, with `max_tokens` defaulting to the rest of the context.
pub fn request(
    c: &Common,
    prompt: Vec<u32>,
    logprobs: Option<usize>,
    max_model_len: usize,
) -> GenerateRequest {
    let max_tokens = c
        .max_tokens
        .unwrap_or_else(|| max_model_len.saturating_sub(prompt.len()).max(1));
    GenerateRequest {
        prompt,
        sampling: SamplingParams {
            max_tokens,
            ..c.sampling.clone()
        },
        frequency_penalty: c.frequency_penalty,
        presence_penalty: c.presence_penalty,
        logprobs,
        ignore_eos: c.ignore_eos,
    }
}
