//! Chat templates rendered like transformers' `apply_chat_template`. Expected strings were
//! produced by Python jinja2 3.1.6 with transformers' environment (`trim_blocks`,
//! `lstrip_blocks`, `tojson` = `json.dumps(ensure_ascii=False)`, `raise_exception`).

use turbokv_model::chat::{CHATML_TEMPLATE, ChatError, ChatMessage, ChatTemplate, strftime};

/// SmolLM2-135M-Instruct's template, as stored in its GGUF.
const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Meta Llama 3 Instruct's template.
const LLAMA3: &str = r#"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>

'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>

' }}{% endif %}"#;

/// A Llama-3.1-style template exercising `.strip()`, `.startswith()`, slicing, `namespace`,
/// `tojson` (with and without `indent`), `raise_exception`, `strftime_now`,
/// `{% generation %}` and whitespace control.
const LLAMA31_STYLE: &str = r#"{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'].strip() %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is defined and tools is not none %}
    {{- "Tools: " + tools | tojson + "\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=2) + "\n" }}
    {%- endfor %}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {%- if message.content.startswith('/') %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n(command) ' + message['content'][1:] | trim + '<|eot_id|>' }}
    {%- else %}
        {%- generation %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
        {%- endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
{#- turns: {{ ns.turns }} #}"#;

fn chat() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "Hi there"),
        ChatMessage::new("assistant", "Hello! How can I help?"),
        ChatMessage::new("user", "What is 2+2?"),
    ]
}

fn chat_with_system() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "  Be brief.  "),
        ChatMessage::new("user", "Hi there"),
        ChatMessage::new("assistant", " Hello! "),
        ChatMessage::new("user", "/help me"),
    ]
}

#[test]
fn smollm2_template_renders_exactly() {
    let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
    assert_eq!(
        t.render(&chat(), true).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.render(&chat_with_system(), false).unwrap(),
        "<|im_start|>system\n  Be brief.  <|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n Hello! <|im_end|>\n<|im_start|>user\n/help me<|im_end|>\n"
    );
}

#[test]
fn llama3_template_renders_exactly() {
    let t = ChatTemplate::new(LLAMA3, "<|begin_of_text|>", "<|eot_id|>").unwrap();
    assert_eq!(
        t.render(&chat_with_system(), true).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n/help me<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn llama31_style_template_with_tools_renders_exactly() {
    let t = ChatTemplate::new(LLAMA31_STYLE, "<|begin_of_text|>", "<|eot_id|>").unwrap();
    let extra = r#"{"date_string": "26 Jul 2024", "tools": [{"name": "get_weather", "parameters": {"city": "string", "units": ["c", "f"]}, "note": "<b>é</b>"}]}"#;
    assert_eq!(
        t.render_with_json(&chat_with_system(), true, extra)
            .unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nTools: [{\"name\": \"get_weather\", \"parameters\": {\"city\": \"string\", \"units\": [\"c\", \"f\"]}, \"note\": \"<b>é</b>\"}]\n{\n  \"name\": \"get_weather\",\n  \"parameters\": {\n    \"city\": \"string\",\n    \"units\": [\n      \"c\",\n      \"f\"\n    ]\n  },\n  \"note\": \"<b>é</b>\"\n}\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n(command) help me<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let mut vars = serde_json::Map::new();
    vars.insert("date_string".into(), "26 Jul 2024".into());
    assert_eq!(
        t.render_with(&chat(), false, &vars).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
    );
    // Without date_string the template calls strftime_now("%d %b %Y").
    let out = t.render(&chat(), false).unwrap();
    let date = out
        .split("Today Date: ")
        .nth(1)
        .unwrap()
        .split('\n')
        .next()
        .unwrap();
    assert_eq!(date.len(), 11, "{date:?}");
}

#[test]
fn raise_exception_is_a_rejection() {
    let t = ChatTemplate::new(LLAMA31_STYLE, "", "").unwrap();
    let bad = [
        ChatMessage::new("assistant", "first"),
        ChatMessage::new("user", "second"),
    ];
    match t.render(&bad, true) {
        Err(ChatError::Rejected { message }) => {
            assert!(message.contains("must alternate"), "{message}")
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn errors_are_typed() {
    assert!(matches!(
        ChatTemplate::new("{% for x in %}", "", ""),
        Err(ChatError::Syntax { .. })
    ));
    let t = ChatTemplate::new("{{ messages[0].content.no_such_method() }}", "", "").unwrap();
    assert!(matches!(
        t.render(&chat(), false),
        Err(ChatError::Render { .. })
    ));
    let t = ChatTemplate::chatml();
    assert!(matches!(
        t.render_with_json(&chat(), false, "[1]"),
        Err(ChatError::Render { .. })
    ));
    assert!(matches!(
        t.render_with_json(&chat(), false, "{"),
        Err(ChatError::Render { .. })
    ));
}

#[test]
fn chatml_fallback() {
    let t = ChatTemplate::chatml();
    assert_eq!(
        t.render(&[ChatMessage::new("user", "hi")], true).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert!(CHATML_TEMPLATE.contains("<|im_start|>"));
}

#[test]
fn strftime_formats_utc() {
    // 2024-07-26 13:05:09 UTC, a Friday.
    let t = 1_721_999_109;
    assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
    assert_eq!(
        strftime("%A %B %e, %y %H:%M:%S %p %j %F %T %%", t),
        "Friday July 26, 24 13:05:09 PM 208 2024-07-26 13:05:09 %"
    );
    assert_eq!(strftime("%Y-%m-%d %I %q", 951_782_400), "2000-02-29 12 %q");
    assert_eq!(strftime("%a %d %b %Y", 0), "Thu 01 Jan 1970");
}

#[test]
fn model_template_from_the_gguf() {
    let path = match std::env::var_os("TURBOKV_MODEL") {
        Some(p) => std::path::PathBuf::from(p),
        None => std::env::var_os("TURBOKV_CACHE")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/turbokv"))
            })
            .unwrap_or_default()
            .join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if !path.exists() {
        println!(
            "SKIPPED: model file {} is absent (set TURBOKV_MODEL)",
            path.display()
        );
        return;
    }
    let gguf = turbokv_model::gguf::GgufFile::open(&path).unwrap();
    let tok = turbokv_model::tokenizer::Tokenizer::from_gguf(&gguf.metadata).unwrap();
    assert_eq!(tok.chat_template(), Some(SMOLLM2));
    let t = ChatTemplate::from_tokenizer(&tok).unwrap();
    let prompt = t
        .render(&[ChatMessage::new("user", "What is 2+2?")], true)
        .unwrap();
    let ids = tok.encode(&prompt, tok.adds_bos(), true).unwrap();
    // The rendered prompt tokenizes with the control tokens intact.
    assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 3);
    assert_eq!(ids.last(), Some(&198));
}
