//! The README's one-line demo answers its question: the main job end to end on the CPU, with
//! the prompt read from the README so the two cannot drift apart. The prompt is one the demo
//! model answers with a wide margin (greedy top-1 ahead of top-2 by ≥ 0.89 logits at every
//! token in llama.cpp's arithmetic), unlike the bare "What is the capital of France?", whose
//! first token is a near-tie that Q8 activations (ours and llama.cpp's) resolve into a
//! rambling answer.

mod common;

use common::{demo_model, stderr, turbokv};

/// The `--prompt` of the README's `cargo run … run` command.
fn readme_demo_prompt() -> String {
    let readme = include_str!("../../../README.md");
    let line = readme
        .lines()
        .find(|l| l.contains("cargo run --release -p turbokv -- run "))
        .expect("the README has the demo command");
    let (_, rest) = line
        .split_once("--prompt \"")
        .expect("the demo command has a quoted --prompt");
    let (prompt, _) = rest.split_once('"').expect("the prompt's closing quote");
    prompt.to_string()
}

#[test]
fn readme_demo_answers_its_question() {
    let Some(model) = demo_model() else { return };
    let prompt = readme_demo_prompt();
    let o = turbokv(&[
        "run",
        "--model",
        &model,
        "--prompt",
        &prompt,
        "--max-tokens",
        "32",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let answer = String::from_utf8_lossy(&o.stdout);
    assert_eq!(answer.trim(), "The capital of France is Paris.", "{err}");
    assert!(err.contains("(eos)"), "the answer ends by itself: {err}");
}
