//! The prompt estimate's error against a real tokenizer (SPEC §24.3): OpenAI's o200k
//! (`tiktoken-rs`, here only) over the corpus in `benches/estimate_corpus/` — English
//! prose, Chinese prose, code, and tool-call JSON (tool definitions, calls whose
//! arguments carry code, tool results). For each class: the estimate of the whole text
//! against its token count (the target is within ±20 %), and the spread over chunks of
//! about 1 KB. Then two requests as agents send them: a 40 KB tool call, and an image
//! (whose estimate follows the providers' published formula, not a tokenizer).
//!
//! Text classes are estimated with `estimate::text_tokens`; the JSON class with
//! `estimate::value_tokens` over each parsed line, against the tokens of the line's text
//! — what a provider tokenizes once it has rendered the JSON.
//!
//! `cargo xtask bench estimate`. Exits 1 when a class misses the target.

use polygw::core::estimate::{image_tokens, request_tokens, text_tokens, value_tokens};
use serde_json::{json, Value};

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/estimate_corpus/");
const TARGET_PCT: f64 = 20.0;

struct Sample {
    estimate: u64,
    tokens: u64,
}

fn pct(e: u64, t: u64) -> f64 {
    (e as f64 - t as f64) / t as f64 * 100.0
}

fn main() {
    let bpe = tiktoken_rs::o200k_base().expect("o200k");
    let count = |s: &str| bpe.encode_ordinary(s).len() as u64;
    println!("prompt estimate vs o200k (tiktoken-rs 0.12), target ±{TARGET_PCT} %");
    println!(
        "{:<10} {:>8} {:>8} {:>9} {:>7} {:>16} {:>12}",
        "class", "chars", "o200k", "estimate", "error", "chunks p50/max", "o200k/char"
    );
    let mut missed = false;
    for (file, class) in [
        ("english.txt", "english"),
        ("chinese.txt", "chinese"),
        ("code.txt", "code"),
        ("tools.jsonl", "tool JSON"),
    ] {
        let text = std::fs::read_to_string(format!("{CORPUS}{file}")).expect("corpus");
        let json = file.ends_with(".jsonl");
        // Chunks of ~1 KB (whole lines; each JSON line is one chunk).
        let mut chunks: Vec<String> = Vec::new();
        let mut cur = String::new();
        for line in text.lines() {
            cur.push_str(line);
            cur.push('\n');
            if json || cur.len() >= 1024 {
                chunks.push(std::mem::take(&mut cur));
            }
        }
        if !cur.trim().is_empty() {
            chunks.push(cur);
        }
        let samples: Vec<Sample> = chunks
            .iter()
            .map(|c| Sample {
                estimate: if json {
                    value_tokens(&serde_json::from_str::<Value>(c).expect("a JSON line"))
                } else {
                    text_tokens(c)
                },
                tokens: count(c.trim_end_matches('\n')),
            })
            .collect();
        let (e, t): (u64, u64) = samples
            .iter()
            .fold((0, 0), |(e, t), s| (e + s.estimate, t + s.tokens));
        let mut errs: Vec<f64> = samples
            .iter()
            .map(|s| pct(s.estimate, s.tokens).abs())
            .collect();
        errs.sort_by(f64::total_cmp);
        let total = pct(e, t);
        missed |= total.abs() > TARGET_PCT;
        println!(
            "{class:<10} {:>8} {t:>8} {e:>9} {total:>+6.1}% {:>7.1}%/{:>5.1}% {:>12.3}{}",
            text.chars().count(),
            errs[errs.len() / 2],
            errs[errs.len() - 1],
            t as f64 / text.chars().count() as f64,
            if total.abs() > TARGET_PCT {
                "  MISSED"
            } else {
                ""
            }
        );
    }

    // A 40 KB tool call as an agent sends it back (an edit whose arguments carry code).
    let code = std::fs::read_to_string(format!("{CORPUS}code.txt")).expect("corpus");
    let mut old = String::new();
    while old.len() < 40_000 {
        old.push_str(&code);
    }
    old.truncate(40_000);
    let args =
        json!({"file_path": "/src/window.rs", "old_string": old, "new_string": "x"}).to_string();
    let body = json!({"model": "m", "messages": [
        {"role": "user", "content": "apply the edit"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "edit_file", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "applied"}
    ]});
    let req: polygw::ChatRequest = serde_json::from_value(body.clone()).expect("request");
    let e = request_tokens(&req);
    let t = count(&body["messages"].to_string());
    // The rule before SPEC §24.3: each message's content as text, bytes / 4, + 4.
    let before: u64 = body["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| {
            let c = match &m["content"] {
                Value::String(s) => s.len(),
                v => v.to_string().len(),
            };
            (c as u64).div_ceil(4) + 4
        })
        .sum();
    println!(
        "\na 40 KB tool call: o200k {t} tokens (the messages' JSON), estimate {e} ({:+.1} %); the rule before (message content only, bytes / 4) said {before}",
        pct(e, t)
    );
    missed |= pct(e, t).abs() > TARGET_PCT;
    // An image: the providers bill by its size, not its bytes.
    let png_1024x768 = "iVBORw0KGgoAAAANSUhEUgAABAAAAAMACAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA==";
    let data = format!("{png_1024x768}{}", "A".repeat(300_000));
    let part =
        json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}});
    println!(
        "a 1024×768 PNG of 300 KB base64: estimate {} tokens (OpenAI's formula 765, Anthropic's 1049: the larger); its base64 as text would be {}",
        value_tokens(&part),
        count(&data)
    );
    assert_eq!(value_tokens(&part), image_tokens(Some((1024, 768)), None));
    if missed {
        eprintln!("a class missed the ±{TARGET_PCT} % target");
        std::process::exit(1);
    }
}
