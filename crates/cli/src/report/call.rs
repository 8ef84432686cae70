//! `polygw report --call ID` (SPEC §19.4): one logical call explained — its rows, one line
//! each, and its decision trace as a timeline ([`CallTrace::timeline`]); with `--html`, a
//! page with the same and its legs as a timeline chart.

use std::process::ExitCode;

use anyhow::{anyhow, Context as _};
use polygw::core::secret::redact_url;
use polygw::core::trace::CallTrace;
use polygw::core::{RowKind, TelemetryRow};

use super::timeline::{tokens_text, trace_row, CallTimeline};
use super::{clean, html, iso, key_names, now_unix_ms, KeyName, ReportArgs};
use crate::table::{money, ms, Table};

/// Longest error detail a row's line shows.
const DETAIL_CHARS: usize = 60;

/// One call as the report shows it.
#[derive(Debug, Clone)]
pub(crate) struct CallView {
    /// The database URL, redacted.
    pub db: String,
    /// The call's rows: attempts in attempt order, then the others by time.
    pub rows: Vec<TelemetryRow>,
    /// The client key's name(s), by id, when known.
    pub key_names: Option<Vec<KeyName>>,
    /// When the view was made (ms since the epoch).
    pub generated_ms: i64,
}

/// The call's trace, or why there is none.
#[derive(Debug, Clone)]
pub(crate) enum Traced {
    /// The trace and the `call_id` of the row that carries it.
    Trace(CallTrace, String),
    /// No row carries one.
    Missing,
    /// The row's trace cannot be read.
    Unreadable(String, String),
}

impl CallView {
    /// The view of `rows` (all of one logical call).
    pub fn new(db: String, mut rows: Vec<TelemetryRow>, key_names: Option<Vec<KeyName>>) -> Self {
        rows.sort_by(|a, b| {
            let rank = |r: &TelemetryRow| match (r.kind, r.attempt_index) {
                (RowKind::Attempt, Some(i)) => (0, i64::from(i)),
                _ => (1, r.created_at_ms),
            };
            rank(a)
                .cmp(&rank(b))
                .then_with(|| a.call_id.cmp(&b.call_id))
        });
        CallView {
            db,
            rows,
            key_names,
            generated_ms: now_unix_ms(),
        }
    }

    /// The call's trace.
    pub fn traced(&self) -> Traced {
        let refs: Vec<&TelemetryRow> = self.rows.iter().collect();
        let Some(r) = trace_row(&refs) else {
            return Traced::Missing;
        };
        match CallTrace::from_json(r.trace.as_deref().unwrap_or_default()) {
            Ok(t) => Traced::Trace(t, r.call_id.clone()),
            Err(e) => Traced::Unreadable(r.call_id.clone(), e.to_string()),
        }
    }

    /// The heading lines.
    pub fn heading(&self) -> Vec<String> {
        let Some(first) = self.rows.first() else {
            return vec![format!("Database: {}", self.db)];
        };
        let mut what = vec![
            format!("scope {}", first.scope),
            first.operation.to_string(),
        ];
        if self.rows.iter().any(|r| r.stream) {
            what.push("streamed".into());
        }
        if let Some(api) = self.rows.iter().find_map(|r| r.api.as_deref()) {
            what.push(format!("api {api}"));
        }
        let mut out = vec![
            format!("Database: {}", self.db),
            format!("Call: {} ({})", first.logical_call_id, what.join(", ")),
        ];
        let mut keys: Vec<&str> = self
            .rows
            .iter()
            .filter_map(|r| r.client_key_id.as_deref())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        for k in keys {
            let name = match &self.key_names {
                Some(names) => match names.iter().find(|n| n.id == k) {
                    Some(n) if n.revoked => format!(" ({}, revoked)", n.name),
                    Some(n) => format!(" ({})", n.name),
                    None => " (not in polygw_client_keys)".into(),
                },
                None => String::new(),
            };
            out.push(format!("Client key: {k}{name}"));
        }
        let (lo, hi) = self.rows.iter().fold((i64::MAX, i64::MIN), |(lo, hi), r| {
            (lo.min(r.created_at_ms), hi.max(r.created_at_ms))
        });
        out.push(format!(
            "Rows: {} (created_at {} to {}, UTC)",
            self.rows.len(),
            iso(lo),
            iso(hi)
        ));
        out
    }

    /// The rows' table: headers and cells.
    pub fn table(&self) -> (Vec<&'static str>, Vec<Vec<String>>) {
        let headers = vec![
            "#", "call_id", "source", "role", "outcome", "latency", "TTFT", "stalls", "tokens",
            "cost",
        ];
        let trace_row = match self.traced() {
            Traced::Trace(_, id) | Traced::Unreadable(id, _) => Some(id),
            Traced::Missing => None,
        };
        let index_of = |call_id: &str| {
            self.rows
                .iter()
                .find(|r| r.call_id == call_id)
                .and_then(|r| r.attempt_index)
                .map_or_else(|| call_id.to_string(), |i| format!("#{i}"))
        };
        let rows = self
            .rows
            .iter()
            .map(|r| {
                let role = match (r.kind, &r.resume_mode) {
                    (RowKind::Attempt, Some(mode)) => {
                        let of = r
                            .resume_of
                            .as_deref()
                            .map(|c| format!(" of {}", index_of(c)))
                            .unwrap_or_default();
                        format!("resume by {mode}{of}")
                    }
                    (RowKind::Attempt, None) if r.is_hedge => "hedge".into(),
                    (RowKind::Attempt, None) if r.attempt_index.unwrap_or(0) > 0 => "retry".into(),
                    (RowKind::Attempt, None) => "primary".into(),
                    (RowKind::CacheHit, _) => "cache hit".into(),
                    (RowKind::TerminalFailure, _) => "call".into(),
                };
                let detail = r
                    .error_detail
                    .as_deref()
                    .map(|d| format!(" ({})", cut(d, DETAIL_CHARS)))
                    .unwrap_or_default();
                let outcome = match (r.kind, r.ok, &r.error) {
                    (RowKind::TerminalFailure, _, e) => format!(
                        "call failed: {}{detail}",
                        e.as_deref().unwrap_or("(no reason)")
                    ),
                    (RowKind::CacheHit, _, _) => "served from the cache".into(),
                    (_, true, _) if trace_row.as_deref() == Some(r.call_id.as_str()) => {
                        "ok: the answer".into()
                    }
                    (_, true, _) => "ok".into(),
                    (_, false, Some(e)) => format!("{e}{detail}"),
                    (_, false, None) => "failed (no label)".into(),
                };
                let stalls = match (r.stall_count, r.stall_ms) {
                    (Some(n), Some(t)) if n > 0 => format!("{n} ({})", ms(Some(t as f64))),
                    (Some(n), _) => n.to_string(),
                    (None, _) => "—".into(),
                };
                vec![
                    r.attempt_index
                        .map_or_else(|| "—".to_string(), |i| i.to_string()),
                    r.call_id.clone(),
                    r.source.as_deref().unwrap_or("—").to_string(),
                    role,
                    outcome,
                    ms(r.latency_ms.map(|v| v as f64)),
                    ms(r.ttft_ms.map(|v| v as f64)),
                    stalls,
                    tokens_text(r),
                    money(r.cost),
                ]
            })
            .collect();
        (headers, rows)
    }

    /// Why there is no timeline, for the error.
    pub fn no_trace(&self, traced: &Traced) -> Option<String> {
        let id = self
            .rows
            .first()
            .map(|r| r.logical_call_id.clone())
            .unwrap_or_default();
        match traced {
            Traced::Trace(..) => None,
            Traced::Missing if self.rows.iter().all(|r| r.kind == RowKind::CacheHit) => Some(
                format!("call {id} was served from the cache: it has no decision trace"),
            ),
            Traced::Missing => Some(format!(
                "call {id} has no decision trace: its rows were written by a polygw older than \
                 the trace (SPEC §19.4), or the call has no last row yet (still running, or \
                 cancelled)"
            )),
            Traced::Unreadable(row, e) => Some(format!(
                "the decision trace on row {row} of call {id} cannot be read: {e}"
            )),
        }
    }

    /// The whole text: heading, rows, timeline (or the reason there is none).
    pub fn text(&self) -> String {
        let mut out = String::from("polygw report --call\n");
        for l in self.heading() {
            out.push_str(&clean(&l));
            out.push('\n');
        }
        out.push_str("\nRows\n");
        let (headers, rows) = self.table();
        let mut t = Table::new(headers);
        for r in &rows {
            t.row(r.iter().map(|c| clean(c)));
        }
        out.push_str(&t.render());
        if let Traced::Trace(trace, row) = self.traced() {
            out.push_str(&format!(
                "\nTimeline (the decision trace on row {}; ms since the call's start)\n",
                clean(&row)
            ));
            for l in trace.timeline() {
                out.push_str(&clean(&l));
                out.push('\n');
            }
        }
        out
    }

    /// The timeline of the legs, for the chart.
    pub fn timeline(&self) -> Option<CallTimeline> {
        match self.traced() {
            Traced::Trace(t, _) => {
                let refs: Vec<&TelemetryRow> = self.rows.iter().collect();
                Some(CallTimeline::of(&t, &refs))
            }
            _ => None,
        }
    }
}

/// `s` cut to `n` characters (with `…`).
fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}

/// `polygw report --call ID [--html FILE]`.
pub(crate) async fn run(args: &ReportArgs, id: &str) -> anyhow::Result<ExitCode> {
    let db = redact_url(&args.db);
    let reader = polygw::telemetry::TelemetryReader::connect(&args.db)
        .await
        .with_context(|| format!("cannot read telemetry rows from {db}"))?;
    let read = reader.call_rows(id).await;
    let names = match &read {
        Ok(rows) if rows.iter().any(|r| r.client_key_id.is_some()) => {
            key_names(&reader, &db).await.flatten()
        }
        _ => None,
    };
    reader.close().await;
    let rows = read.with_context(|| format!("cannot read telemetry rows from {db}"))?;
    if rows.is_empty() {
        return Err(anyhow!(
            "no telemetry row in {db} has the logical_call_id or call_id {}",
            clean(id)
        ));
    }
    let view = CallView::new(db, rows, names);
    print!("{}", view.text());
    let traced = view.traced();
    if let Some(why) = view.no_trace(&traced) {
        return Err(anyhow!("{}", clean(&why)));
    }
    if let Some(path) = &args.html {
        tokio::fs::write(path, html::render_call(&view))
            .await
            .with_context(|| format!("cannot write the HTML report to {}", path.display()))?;
        println!("HTML report: {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::super::timeline::tests::stalled_trace;
    use super::*;
    use polygw::UsageSource;

    fn rows() -> Vec<TelemetryRow> {
        let mut a = TelemetryRow::new(RowKind::Attempt, "c-a", "c", "LLM", "chat", 10_000);
        a.source = Some("a-0".into());
        a.attempt_index = Some(0);
        a.stream = true;
        a.error = Some("hedge_cancelled".into());
        a.latency_ms = Some(950);
        a.ttft_ms = Some(120);
        a.stall_count = Some(1);
        a.stall_ms = Some(780);
        a.client_key_id = Some("key_1".into());
        let mut b = TelemetryRow::new(RowKind::Attempt, "c-b", "c", "LLM", "chat", 10_500);
        b.source = Some("b-0".into());
        b.attempt_index = Some(1);
        b.is_hedge = true;
        b.resume_mode = Some("prefill".into());
        b.resume_of = Some("c-a".into());
        b.ok = true;
        b.usage_source = UsageSource::Measured;
        b.prompt_tokens = Some(40);
        b.completion_tokens = Some(12);
        b.cost = Some(0.000_3);
        b.latency_ms = Some(500);
        b.client_key_id = Some("key_1".into());
        b.trace = Some(stalled_trace().to_json());
        // Out of order: the view sorts them.
        vec![b, a]
    }

    fn view(rows: Vec<TelemetryRow>) -> CallView {
        CallView::new(
            "sqlite://t.db".into(),
            rows,
            Some(vec![KeyName {
                id: "key_1".into(),
                name: "team-a".into(),
                revoked: false,
            }]),
        )
    }

    #[test]
    fn a_call_reads_as_its_rows_and_its_timeline() {
        let text = view(rows()).text();
        for want in [
            "Call: c (scope LLM, chat, streamed)",
            "Client key: key_1 (team-a)",
            "Rows: 2 (created_at 1970-01-01T00:00:10.000Z to 1970-01-01T00:00:10.500Z, UTC)",
            "Timeline (the decision trace on row c-b; ms since the call's start)",
            "leg 1 launched on b-0: resume by prefill on its stall trigger",
            "leg 0 cancelled (hedge_cancelled)",
            "1400 ms  leg 1 won",
        ] {
            assert!(text.contains(want), "{want:?} in\n{text}");
        }
        let line = |prefix: &str| -> Vec<String> {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix:?} in\n{text}"))
                .split("  ")
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .map(str::to_string)
                .collect()
        };
        assert_eq!(
            line("0 "),
            [
                "0",
                "c-a",
                "a-0",
                "primary",
                "hedge_cancelled",
                "950 ms",
                "120 ms",
                "1 (780 ms)",
                "—",
                "unknown"
            ]
        );
        assert_eq!(
            line("1 "),
            [
                "1",
                "c-b",
                "b-0",
                "resume by prefill of #0",
                "ok: the answer",
                "500 ms",
                "—",
                "—",
                "40/12",
                "0.000300"
            ]
        );
        let v = view(rows());
        assert!(v.no_trace(&v.traced()).is_none());
        assert_eq!(v.timeline().unwrap().legs.len(), 2);
    }

    #[test]
    fn the_call_page_has_its_rows_chart_and_timeline() {
        let doc = html::render_call(&view(rows()));
        assert!(doc.starts_with("<!DOCTYPE html>"));
        assert!(doc.contains("<svg id=\"call-timelines\""));
        assert_eq!(doc.matches("class=\"leg leg-").count(), 2);
        assert!(doc.contains("<pre id=\"call-trace\">"));
        assert!(doc.contains("1400 ms  leg 1 won"));
        assert!(doc.contains("<td>resume by prefill of #0</td>"));
        assert!(doc.contains("Client key: key_1 (team-a)"));
        for bad in [
            "<script", "<link", "<img", " src=", " href=", "http://", "https://",
        ] {
            assert!(!doc.contains(bad), "{bad}");
        }
    }

    #[test]
    fn no_trace_says_why() {
        let mut old = rows();
        for r in &mut old {
            r.trace = None;
        }
        let v = view(old);
        let why = v.no_trace(&v.traced()).unwrap();
        assert!(why.contains("call c has no decision trace"), "{why}");
        assert!(why.contains("older than the trace"), "{why}");
        assert!(!v.text().contains("Timeline"));

        let mut bad = rows();
        bad[0].trace = Some("{oops".into());
        let v = view(bad);
        let why = v.no_trace(&v.traced()).unwrap();
        assert!(why.contains("on row c-b of call c cannot be read"), "{why}");

        let mut hit = TelemetryRow::new(RowKind::CacheHit, "h", "hc", "LLM", "chat", 1);
        hit.ok = true;
        let v = view(vec![hit]);
        let why = v.no_trace(&v.traced()).unwrap();
        assert!(why.contains("served from the cache"), "{why}");
        assert!(v.text().contains("served from the cache"));
    }

    #[test]
    fn a_terminal_row_and_a_long_detail() {
        let mut rows = rows();
        rows[1].error = Some("server_error".into());
        rows[1].error_detail = Some(format!("HTTP 502 {}\u{1b}[31m", "x".repeat(100)));
        let mut t = TelemetryRow::new(RowKind::TerminalFailure, "c-t", "c", "LLM", "chat", 11_000);
        t.error = Some("retry_exhausted".into());
        t.latency_ms = Some(1_000);
        rows.push(t);
        let text = view(rows).text();
        assert!(text.contains("call failed: retry_exhausted"), "{text}");
        assert!(text.contains("server_error (HTTP 502 xxx"), "{text}");
        assert!(text.contains("x…)"), "{text}");
        assert!(!text.contains('\u{1b}'));
    }
}
