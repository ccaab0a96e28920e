//! Chat templates: a model's own Jinja template rendered the way Hugging Face
//! `apply_chat_template` renders it.
//!
//! The environment matches transformers': `trim_blocks` and `lstrip_blocks` on, Python
//! string/dict/list methods (`.strip()`, `.startswith()`, `.items()` via
//! `minijinja-contrib`'s pycompat), `raise_exception(msg)`, `strftime_now(fmt)` and a
//! `tojson` with Python's separators and no HTML escaping. The context holds `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token` and any extra variables (`tools`, ...).
//!
//! A model without a template is an error ([`ChatError::NoTemplate`]); ChatML is used only
//! when asked for, through [`ChatTemplate::chatml`] or [`ChatTemplate::from_tokenizer_or_chatml`].

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::tokenizer::Tokenizer;

/// Name under which the template is registered.
const NAME: &str = "chat";

/// Marks errors raised by the template itself through `raise_exception`.
const RAISED: &str = "raise_exception: ";

/// ChatML, the fallback template (`<|im_start|>role\ncontent<|im_end|>\n`).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Errors preparing or rendering a chat template.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// The model ships no chat template.
    #[error(
        "the model has no chat template (tokenizer.chat_template / tokenizer_config.json); \
         pass a template explicitly or ask for the ChatML fallback"
    )]
    NoTemplate,
    /// The template does not parse.
    #[error("chat template does not compile: {message}")]
    Syntax {
        /// The parser's message, with the location.
        message: String,
    },
    /// The template called `raise_exception`, e.g. because roles do not alternate.
    #[error("the chat template rejected the conversation: {message}")]
    Rejected {
        /// The template's message.
        message: String,
    },
    /// Rendering failed (undefined variable used wrongly, type error...).
    #[error("chat template failed to render: {message}")]
    Render {
        /// The engine's message, with the location.
        message: String,
    },
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the special-token strings it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source` (Jinja) with the BOS/EOS strings the template may print.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, strip_generation_tags(source))
            .map_err(|e| ChatError::Syntax {
                message: describe(&e),
            })?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The tokenizer's own template, with its BOS/EOS strings; [`ChatError::NoTemplate`]
    /// if it has none.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Self, ChatError> {
        let source = tokenizer.chat_template().ok_or(ChatError::NoTemplate)?;
        Self::new(
            source,
            &tokenizer.bos_token().unwrap_or_default(),
            &tokenizer.eos_token().unwrap_or_default(),
        )
    }

    /// The tokenizer's template, or ChatML when it has none (logged). Use only where the
    /// caller has opted into the fallback: a model not trained on ChatML answers poorly.
    pub fn from_tokenizer_or_chatml(tokenizer: &Tokenizer) -> Result<Self, ChatError> {
        match Self::from_tokenizer(tokenizer) {
            Err(ChatError::NoTemplate) => {
                tracing::warn!("model has no chat template; using ChatML as requested");
                Self::new(
                    CHATML_TEMPLATE,
                    &tokenizer.bos_token().unwrap_or_default(),
                    &tokenizer.eos_token().unwrap_or_default(),
                )
            }
            other => other,
        }
    }

    /// The ChatML template ([`CHATML_TEMPLATE`]).
    pub fn chatml() -> Self {
        // A constant that compiles (tested), so `Syntax` cannot occur; keep the error path anyway.
        Self::new(CHATML_TEMPLATE, "", "").unwrap_or_else(|_| Self {
            env: Environment::new(),
            bos_token: String::new(),
            eos_token: String::new(),
        })
    }

    /// Renders `messages`; `add_generation_prompt` appends the assistant turn's header.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_value(messages, add_generation_prompt, Value::UNDEFINED)
    }

    /// Renders with extra template variables (`tools`, `documents`, `date_string`...); the
    /// standard ones (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`) win over
    /// extras of the same name. Object keys render in `serde_json::Map` order (sorted unless
    /// serde_json's `preserve_order` is on); [`render_with_json`](Self::render_with_json)
    /// keeps the order of the text.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        self.render_value(
            messages,
            add_generation_prompt,
            Value::from_serialize(extra),
        )
    }

    /// Like [`render_with`](Self::render_with), with the extra variables given as the text of
    /// a JSON object (e.g. `{"tools": [...]}` from a request), keeping its key order.
    pub fn render_with_json(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra_json: &str,
    ) -> Result<String, ChatError> {
        let extra: Value = serde_json::from_str(extra_json).map_err(|e| ChatError::Render {
            message: format!("extra variables are not valid JSON: {e}"),
        })?;
        if extra.kind() != minijinja::value::ValueKind::Map {
            return Err(ChatError::Render {
                message: "extra variables must be a JSON object".into(),
            });
        }
        self.render_value(messages, add_generation_prompt, extra)
    }

    fn render_value(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: Value,
    ) -> Result<String, ChatError> {
        let template = self.env.get_template(NAME).map_err(|e| ChatError::Render {
            message: describe(&e),
        })?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..extra
        };
        template
            .render(ctx)
            .map_err(|e| match e.detail().and_then(|d| d.strip_prefix(RAISED)) {
                Some(message) if e.kind() == ErrorKind::InvalidOperation => ChatError::Rejected {
                    message: message.to_owned(),
                },
                _ => ChatError::Render {
                    message: describe(&e),
                },
            })
    }
}

/// The error with its cause chain and template location.
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{message}"),
    ))
}

fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, secs)
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`
/// (separators `", "`/`": "`, no HTML escaping).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    // Serialised straight from the template value, keeping its key order.
    let json = &value;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            serde::Serialize::serialize(json, &mut ser)
        }
        None => serde::Serialize::serialize(
            json,
            &mut serde_json::Serializer::with_formatter(&mut out, PyFormatter),
        ),
    };
    written
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(
        String::from_utf8_lossy(&out).into_owned(),
    ))
}

/// JSON with Python's default separators.
struct PyFormatter;

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// Removes transformers' `{% generation %}` / `{% endgeneration %}` markers (assistant-mask
/// tags that do not affect the text).
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start..start + len + 2];
        let inner =
            tag[2..tag.len() - 2].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        if inner != "generation" && inner != "endgeneration" {
            out.push_str(tag);
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Civil date (year, month 1-12, day 1-31) of a day count since 1970-01-01 (H. Hinnant).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// A subset of C `strftime` over UTC seconds since the epoch: `%Y %y %m %d %e %B %b %h %A %a
/// %j %H %I %M %S %p %F %T %%`; other sequences are copied as written.
pub fn strftime(format: &str, unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let secs = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = DAYS[(days + 3).rem_euclid(7) as usize]; // 1970-01-01 was a Thursday.
    let month_name = MONTHS[(month - 1) as usize];
    let jan1 = days - (1..month).map(|m| days_in_month(year, m)).sum::<i64>() - i64::from(day) + 1;
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let piece = match spec {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'B' => month_name.to_owned(),
            'b' | 'h' => month_name[..3].to_owned(),
            'A' => weekday.to_owned(),
            'a' => weekday[..3].to_owned(),
            'j' => format!("{:03}", days - jan1 + 1),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", if hour % 12 == 0 { 12 } else { hour % 12 }),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_owned(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            '%' => "%".to_owned(),
            other => format!("%{other}"),
        };
        out.push_str(&piece);
    }
    out
}

fn days_in_month(year: i64, month: u32) -> i64 {
    match month {
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}
