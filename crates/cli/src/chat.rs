//! `polygw chat`: one call with the environment's configuration.

use std::io::{Read, Write};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use polygw::{ChatRequest, DeltaSink, GatewayClient, GatewayError, Message, StreamDelta};

use crate::env;

/// Arguments of `polygw chat`.
#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// The scope to call.
    #[arg(long, default_value = "LLM")]
    pub scope: String,
    /// Stream from the upstream, printing the answer as it arrives.
    #[arg(long)]
    pub stream: bool,
    /// Print the whole response as JSON, with `call_stats`.
    #[arg(long)]
    pub json: bool,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Output cap.
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Sampling temperature.
    #[arg(long)]
    pub temperature: Option<f64>,
    /// The prompt (`-` reads it from standard input).
    pub prompt: String,
}

struct Printer;

impl DeltaSink for Printer {
    fn send(&self, delta: StreamDelta) {
        if let Some(c) = &delta.content {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(c.as_bytes());
            let _ = out.flush();
        }
    }
}

/// Exit code of a failed call: 2 for configuration and request errors, 1 otherwise.
pub fn exit_code(e: &GatewayError) -> ExitCode {
    match e {
        GatewayError::Config(_) | GatewayError::InvalidRequest { .. } => ExitCode::from(2),
        _ => ExitCode::FAILURE,
    }
}

pub async fn run(args: ChatArgs) -> Result<ExitCode> {
    let prompt = if args.prompt == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading the prompt from standard input")?;
        s
    } else {
        args.prompt.clone()
    };
    let client = match GatewayClient::from_env(&args.scope).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(exit_code(&e));
        }
    };
    env::print_warnings(&client.settings().name, client.warnings());
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(Message::system(s.clone()));
    }
    messages.push(Message::user(prompt));
    let mut req = ChatRequest::new(messages).with_stream(args.stream);
    req.max_tokens = args.max_tokens;
    req.temperature = args.temperature;
    let live = args.stream && !args.json;
    let result = if live {
        client.chat_streaming(req, Arc::new(Printer)).await
    } else {
        client.chat(req).await
    };
    let report = client.shutdown().await;
    if report.dropped > 0 {
        eprintln!("warning: {} telemetry rows were dropped", report.dropped);
    }
    match result {
        Ok(r) => {
            if args.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else if live {
                println!();
            } else {
                println!("{}", r.content);
            }
            if !args.json {
                let s = &r.call_stats;
                eprintln!(
                    "[{} via {} · {} ms · attempts {} · hedges {} · tokens {}+{} ({})]",
                    r.model,
                    r.source,
                    s.total_latency_ms,
                    s.attempts,
                    s.hedges,
                    r.usage.prompt_tokens,
                    r.usage.completion_tokens,
                    r.usage_source
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            if live {
                println!();
            }
            eprintln!("error: {e}");
            Ok(exit_code(&e))
        }
    }
}
