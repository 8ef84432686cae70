//! The `--html` output of `polygw report`: one self-contained HTML file (inline CSS, inline
//! SVG charts drawn here, no script, no font, no external resource), every piece of data
//! escaped.

use std::fmt::Write as _;

use super::call::{CallView, Traced};
use super::stats::{error_labels, Scatter, Summary};
use super::timeline::{CallTimeline, LegEnd, LegSpan, MAX_TIMELINE_CALLS};
use super::{gap_line, heading_lines, iso, sections, Context, Section, MAX_SCATTER_POINTS, NO_KEY};
use crate::table::{money, ms, pct};

/// Series colours (colour-blind friendly "Tableau 10").
const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];
const OK_COLOUR: &str = "#59a14f";
const FAILED_COLOUR: &str = "#e15759";

/// Chart width in SVG units.
const WIDTH: f64 = 900.0;

const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;\
color:#222;max-width:1100px}h1{margin-bottom:4px}h2{margin-top:32px;border-bottom:1px solid #ddd}\
.meta{color:#555;margin:2px 0}.note{color:#666;font-size:13px;margin:4px 0 8px}\
table{border-collapse:collapse;font-size:13px;margin-bottom:8px}\
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}\
th:first-child,td:first-child{text-align:left}td.free{text-align:left;white-space:normal}\
.empty{color:#888;font-style:italic}figure{margin:16px 0}figcaption{font-weight:600;margin-bottom:4px}\
svg{display:block;max-width:100%;height:auto}svg text{font-size:11px;fill:#333}\
svg .ax{stroke:#ccc;stroke-width:1}svg .lbl{font-size:12px}footer{margin-top:32px;color:#888;font-size:12px}\
svg .call{font-size:12px;font-weight:600}pre{font-size:12px;background:#f7f7f7;padding:8px;overflow-x:auto}";

/// The page's Content-Security-Policy: nothing may be loaded or run — inline CSS and SVG
/// only. A browser reports any breach in its console (the browser test reads it).
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src 'none'; \
                   script-src 'none'; base-uri 'none'; form-action 'none'";

/// Escapes text for HTML content and quoted attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A coordinate with one decimal (keeps the file small).
fn n(v: f64) -> String {
    let r = (v * 10.0).round() / 10.0;
    if r == r.trunc() {
        format!("{r:.0}")
    } else {
        format!("{r:.1}")
    }
}

/// A tick step of 1, 2 or 5 × 10^k giving about `target` steps up to `max`.
pub fn nice_step(max: f64, target: f64) -> f64 {
    if !(max.is_finite() && max > 0.0) {
        return 1.0;
    }
    let raw = max / target;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn plain(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn ms_fmt(v: f64) -> String {
    ms(Some(v))
}

fn pct_fmt(v: f64) -> String {
    pct(Some(v))
}

fn money_fmt(v: f64) -> String {
    money(Some(v))
}

/// Longest category label drawn in a chart (the full name is in its tooltip).
const LABEL_CHARS: usize = 40;

/// A category label cut to [`LABEL_CHARS`].
fn short(s: &str) -> String {
    if s.chars().count() <= LABEL_CHARS {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(LABEL_CHARS - 1).collect();
        t.push('…');
        t
    }
}

/// Horizontal bars, one group per category, grouped or stacked series.
struct BarChart {
    title: String,
    note: String,
    series: Vec<(String, &'static str)>,
    cats: Vec<String>,
    /// `values[cat][series]`.
    values: Vec<Vec<Option<f64>>>,
    stacked: bool,
    fmt: fn(f64) -> String,
    /// Fixed axis maximum (rates: 1.0).
    max: Option<f64>,
    /// Extra text after each category's bars (may be empty).
    notes: Vec<String>,
}

impl BarChart {
    fn render(&self) -> String {
        let mut out = format!("<figure><figcaption>{}</figcaption>", esc(&self.title));
        if !self.note.is_empty() {
            let _ = write!(out, "<p class=\"note\">{}</p>", esc(&self.note));
        }
        let data_max = self
            .values
            .iter()
            .map(|row| {
                if self.stacked {
                    row.iter().flatten().sum::<f64>()
                } else {
                    row.iter().flatten().fold(0.0, |a: f64, b| a.max(*b))
                }
            })
            .fold(0.0, f64::max);
        if self.cats.is_empty() || (self.max.is_none() && data_max <= 0.0) {
            out.push_str("<p class=\"empty\">no data</p></figure>");
            return out;
        }
        let max = self.max.unwrap_or(data_max).max(data_max);
        let step = nice_step(max, 5.0);
        let axis_max = (max / step).ceil() * step;

        let longest = self
            .cats
            .iter()
            .map(|c| c.chars().count().min(LABEL_CHARS))
            .max()
            .unwrap_or(0);
        let x0 = (longest as f64 * 7.4 + 16.0).clamp(80.0, 320.0);
        let x1 = WIDTH - 230.0;
        let scale = |v: f64| (v / axis_max) * (x1 - x0);
        let ns = self.series.len().max(1);
        let bar_h = if self.stacked { 16.0 } else { 11.0 };
        let group_h = if self.stacked {
            24.0
        } else {
            ns as f64 * bar_h + 10.0
        };
        let top = 30.0;
        let plot_h = self.cats.len() as f64 * group_h;
        let height = top + plot_h + 26.0;
        let _ = write!(
            out,
            "<svg viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\" role=\"img\" \
             aria-label=\"{}\">",
            n(WIDTH),
            n(height),
            n(WIDTH),
            n(height),
            esc(&self.title)
        );
        // Legend.
        let mut lx = x0;
        for (name, colour) in &self.series {
            let _ = write!(
                out,
                "<rect x=\"{}\" y=\"8\" width=\"10\" height=\"10\" fill=\"{colour}\"/>\
                 <text x=\"{}\" y=\"17\">{}</text>",
                n(lx),
                n(lx + 14.0),
                esc(name)
            );
            lx += 14.0 + name.chars().count() as f64 * 6.6 + 16.0;
        }
        // Grid and ticks.
        let mut t = 0.0;
        while t <= axis_max * (1.0 + 1e-9) {
            let x = x0 + scale(t);
            let _ = write!(
                out,
                "<line class=\"ax\" x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\"/>\
                 <text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                n(top - 4.0),
                n(top + plot_h),
                n(top + plot_h + 14.0),
                esc(&(self.fmt)(t)),
                x = n(x),
            );
            t += step;
        }
        for (i, cat) in self.cats.iter().enumerate() {
            let gy = top + i as f64 * group_h;
            let _ = write!(
                out,
                "<text class=\"lbl\" x=\"{}\" y=\"{}\" text-anchor=\"end\">{}<title>{}</title>\
                 </text>",
                n(x0 - 6.0),
                n(gy + group_h / 2.0 + 4.0),
                esc(&short(cat)),
                esc(cat)
            );
            let row = &self.values[i];
            if self.stacked {
                let y = gy + (group_h - bar_h) / 2.0;
                let mut acc = 0.0;
                for (j, v) in row.iter().enumerate() {
                    let Some(v) = v.filter(|v| *v > 0.0) else {
                        continue;
                    };
                    let (name, colour) = &self.series[j];
                    let _ = write!(
                        out,
                        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{colour}\">\
                         <title>{}</title></rect>",
                        n(x0 + scale(acc)),
                        n(y),
                        n(scale(v).max(0.5)),
                        n(bar_h),
                        esc(&format!("{cat} — {name}: {}", (self.fmt)(v)))
                    );
                    acc += v;
                }
                let _ = write!(
                    out,
                    "<text x=\"{}\" y=\"{}\">{}</text>",
                    n(x0 + scale(acc) + 4.0),
                    n(y + bar_h - 4.0),
                    esc(&(self.fmt)(acc))
                );
            } else {
                for (j, v) in row.iter().enumerate() {
                    let (name, colour) = &self.series[j];
                    let y = gy + 5.0 + j as f64 * bar_h;
                    let label = match v {
                        Some(v) => {
                            let w = scale(*v).max(if *v > 0.0 { 0.5 } else { 0.0 });
                            let _ = write!(
                                out,
                                "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" \
                                 fill=\"{colour}\"><title>{}</title></rect>",
                                n(x0),
                                n(y),
                                n(w),
                                n(bar_h - 2.0),
                                esc(&format!("{cat} — {name}: {}", (self.fmt)(*v)))
                            );
                            (self.fmt)(*v)
                        }
                        None => "—".to_string(),
                    };
                    let _ = write!(
                        out,
                        "<text x=\"{}\" y=\"{}\">{}</text>",
                        n(x0 + v.map_or(0.0, scale) + 4.0),
                        n(y + bar_h - 3.0),
                        esc(&label)
                    );
                }
            }
            if let Some(note) = self.notes.get(i).filter(|s| !s.is_empty()) {
                let _ = write!(
                    out,
                    "<text x=\"{}\" y=\"{}\" fill=\"#888\">{}</text>",
                    n(x1 + 65.0),
                    n(gy + group_h / 2.0 + 4.0),
                    esc(note)
                );
            }
        }
        out.push_str("</svg></figure>");
        out
    }
}

/// The latency-over-time scatter (log latency axis), successes and failures in two
/// colours.
fn scatter_chart(sc: &Scatter) -> String {
    let mut out = String::from("<figure><figcaption>Attempt latency over time</figcaption>");
    let shown = sc.points.len();
    let note = if sc.stride > 1 {
        format!(
            "{shown} of {} attempts shown (1 in {} of the successes and of the failures, \
             at most {MAX_SCATTER_POINTS} points); x: created_at (UTC), y: latency_ms (log \
             scale).",
            sc.total, sc.stride
        )
    } else {
        format!("All {shown} attempts; x: created_at (UTC), y: latency_ms (log scale).")
    };
    let _ = write!(out, "<p class=\"note\">{}</p>", esc(&note));
    if sc.points.is_empty() {
        out.push_str("<p class=\"empty\">no attempt with a latency</p></figure>");
        return out;
    }
    let (l, r, t, b) = (70.0, 20.0, 28.0, 40.0);
    let height = 340.0;
    let (pw, ph) = (WIDTH - l - r, height - t - b);
    let tmin = sc.points.iter().map(|p| p.at_ms).min().unwrap_or(0);
    let mut tmax = sc.points.iter().map(|p| p.at_ms).max().unwrap_or(0);
    if tmax <= tmin {
        tmax = tmin + 1_000;
    }
    let lmin = sc
        .points
        .iter()
        .map(|p| p.latency_ms.max(1.0))
        .fold(f64::INFINITY, f64::min);
    let lmax = sc
        .points
        .iter()
        .map(|p| p.latency_ms.max(1.0))
        .fold(1.0, f64::max);
    let lo = lmin.log10().floor();
    let mut hi = lmax.log10().ceil();
    if hi <= lo {
        hi = lo + 1.0;
    }
    let xs = |at: i64| l + (at - tmin) as f64 / (tmax - tmin) as f64 * pw;
    let ys = |lat: f64| t + ph - (lat.max(1.0).log10() - lo) / (hi - lo) * ph;

    let _ = write!(
        out,
        "<svg viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\" \
         aria-label=\"Attempt latency over time\">",
        w = n(WIDTH),
        h = n(height)
    );
    let ok = sc.points.iter().filter(|p| p.ok).count();
    let _ = write!(
        out,
        "<circle cx=\"{}\" cy=\"13\" r=\"4\" fill=\"{OK_COLOUR}\"/><text x=\"{}\" y=\"17\">ok \
         ({ok})</text><circle cx=\"{}\" cy=\"13\" r=\"4\" fill=\"{FAILED_COLOUR}\"/><text \
         x=\"{}\" y=\"17\">failed ({})</text>",
        n(l + 4.0),
        n(l + 12.0),
        n(l + 104.0),
        n(l + 112.0),
        shown - ok
    );
    // Y ticks at powers of ten.
    let mut e = lo;
    while e <= hi + 1e-9 {
        let y = ys(10f64.powf(e));
        let _ = write!(
            out,
            "<line class=\"ax\" x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\"/><text x=\"{}\" \
             y=\"{}\" text-anchor=\"end\">{}</text>",
            n(l),
            n(l + pw),
            n(l - 6.0),
            n(ys(10f64.powf(e)) + 4.0),
            esc(&ms(Some(10f64.powf(e)))),
            y = n(y)
        );
        e += 1.0;
    }
    // X ticks: five instants.
    let long = tmax - tmin > 86_400_000;
    for i in 0..=4 {
        let at = tmin + (tmax - tmin) * i / 4;
        let x = xs(at);
        let stamp = iso(at);
        let label = if long {
            format!("{} {}", &stamp[5..10], &stamp[11..16])
        } else {
            stamp[11..19].to_string()
        };
        let anchor = match i {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        let _ = write!(
            out,
            "<line class=\"ax\" x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\"/><text x=\"{x}\" \
             y=\"{}\" text-anchor=\"{anchor}\">{}</text>",
            n(t),
            n(t + ph),
            n(t + ph + 16.0),
            esc(&label),
            x = n(x)
        );
    }
    let _ = write!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#666\">{} → {} (UTC)</text>",
        n(l + pw / 2.0),
        n(height - 4.0),
        esc(&iso(tmin)),
        esc(&iso(tmax))
    );
    for (ok, colour) in [(true, OK_COLOUR), (false, FAILED_COLOUR)] {
        let _ = write!(out, "<g fill=\"{colour}\" fill-opacity=\"0.6\">");
        for p in sc.points.iter().filter(|p| p.ok == ok) {
            let _ = write!(
                out,
                "<circle cx=\"{}\" cy=\"{}\" r=\"1.8\"/>",
                n(xs(p.at_ms)),
                n(ys(p.latency_ms))
            );
        }
        out.push_str("</g>");
    }
    out.push_str("</svg></figure>");
    out
}

fn charts(sum: &Summary, sc: &Scatter) -> String {
    let cats: Vec<String> = sum
        .sources
        .iter()
        .map(|s| format!("{}/{}", s.scope, s.source))
        .collect();
    let pcts = |c: usize| -> Vec<(String, &'static str)> {
        ["p50", "p95", "p99"]
            .iter()
            .take(c)
            .enumerate()
            .map(|(i, s)| (s.to_string(), PALETTE[i]))
            .collect()
    };
    let mut out = String::new();
    out.push_str(
        &BarChart {
            title: "Attempt latency per source".into(),
            note: "latency_ms of ok attempts, nearest-rank percentiles.".into(),
            series: pcts(3),
            cats: cats.clone(),
            values: sum
                .sources
                .iter()
                .map(|s| vec![s.latency.p50, s.latency.p95, s.latency.p99])
                .collect(),
            stacked: false,
            fmt: ms_fmt,
            max: None,
            notes: sum
                .sources
                .iter()
                .map(|s| format!("n={}", s.latency.n))
                .collect(),
        }
        .render(),
    );
    out.push_str(
        &BarChart {
            title: "Time to first token per source".into(),
            note: "ttft_ms of ok streamed attempts (first incremental chunk).".into(),
            series: pcts(3),
            cats: cats.clone(),
            values: sum
                .sources
                .iter()
                .map(|s| vec![s.ttft.p50, s.ttft.p95, s.ttft.p99])
                .collect(),
            stacked: false,
            fmt: ms_fmt,
            max: None,
            notes: sum
                .sources
                .iter()
                .map(|s| format!("n={}", s.ttft.n))
                .collect(),
        }
        .render(),
    );
    out.push_str(
        &BarChart {
            title: "Stall share per source".into(),
            note: "Σ stall_ms / Σ latency_ms of ok streamed attempts; the note gives the \
                   attempts with at least one stall."
                .into(),
            series: vec![("stall share".into(), PALETTE[2])],
            cats: cats.clone(),
            values: sum.sources.iter().map(|s| vec![s.stall_share()]).collect(),
            stacked: false,
            fmt: pct_fmt,
            max: Some(1.0),
            notes: sum
                .sources
                .iter()
                .map(|s| format!("stalled {}/{}", s.stalled_attempts, s.streamed_ok))
                .collect(),
        }
        .render(),
    );
    let labels = error_labels(&sum.sources);
    out.push_str(
        &BarChart {
            title: "Failed attempts by error label".into(),
            note: "Failed attempts per source, stacked by label; the note gives the source's \
                   attempts."
                .into(),
            series: labels
                .iter()
                .enumerate()
                .map(|(i, l)| (l.clone(), PALETTE[i % PALETTE.len()]))
                .collect(),
            cats: cats.clone(),
            values: sum
                .sources
                .iter()
                .map(|s| {
                    labels
                        .iter()
                        .map(|l| s.errors.get(l).map(|v| *v as f64))
                        .collect()
                })
                .collect(),
            stacked: true,
            fmt: plain,
            max: None,
            notes: sum
                .sources
                .iter()
                .map(|s| format!("of {} attempts", s.attempts))
                .collect(),
        }
        .render(),
    );
    out.push_str(
        &BarChart {
            title: "Hedging per scope".into(),
            note: "Hedge rate: calls with an extra leg / calls that reached a source. Win \
                   rate: hedged calls won by an extra leg / hedged calls."
                .into(),
            series: vec![
                ("hedge rate".into(), PALETTE[0]),
                ("hedge win rate".into(), PALETTE[1]),
            ],
            cats: sum.scopes.iter().map(|s| s.scope.clone()).collect(),
            values: sum
                .scopes
                .iter()
                .map(|s| vec![s.hedge_rate(), s.hedge_win_rate()])
                .collect(),
            stacked: false,
            fmt: pct_fmt,
            max: Some(1.0),
            notes: sum
                .scopes
                .iter()
                .map(|s| format!("{}/{} hedged", s.hedged_calls, s.calls_with_attempts))
                .collect(),
        }
        .render(),
    );
    out.push_str(
        &BarChart {
            title: "Hedge legs per source".into(),
            note: "Extra legs launched on each source and how many of them won.".into(),
            series: vec![
                ("hedge legs".into(), PALETTE[0]),
                ("hedge wins".into(), PALETTE[4]),
            ],
            cats: cats.clone(),
            values: sum
                .sources
                .iter()
                .map(|s| vec![Some(s.hedge_legs as f64), Some(s.hedge_wins as f64)])
                .collect(),
            stacked: false,
            fmt: plain,
            max: None,
            notes: Vec::new(),
        }
        .render(),
    );
    out.push_str(
        &BarChart {
            title: "Tokens per source".into(),
            note: "Sums over attempts with known usage.".into(),
            series: vec![
                ("prompt".into(), PALETTE[0]),
                ("completion".into(), PALETTE[1]),
            ],
            cats: cats.clone(),
            values: sum
                .sources
                .iter()
                .map(|s| {
                    let known = s.tokens.rows > 0;
                    vec![
                        known.then_some(s.tokens.prompt as f64),
                        known.then_some(s.tokens.completion as f64),
                    ]
                })
                .collect(),
            stacked: true,
            fmt: plain,
            max: None,
            notes: sum
                .sources
                .iter()
                .map(|s| format!("usage known {}/{}", s.tokens.rows, s.attempts))
                .collect(),
        }
        .render(),
    );
    out.push_str(
        &BarChart {
            title: "Known cost per source".into(),
            note: "Sum of the known costs; the note counts attempts whose cost is unknown \
                   (NULL), which are not in the bar."
                .into(),
            series: vec![("known cost".into(), PALETTE[4])],
            cats,
            values: sum
                .sources
                .iter()
                .map(|s| vec![s.cost.known_sum()])
                .collect(),
            stacked: false,
            fmt: money_fmt,
            max: None,
            notes: sum
                .sources
                .iter()
                .map(|s| format!("unknown: {}", s.cost.unknown_rows))
                .collect(),
        }
        .render(),
    );
    out.push_str(&scatter_chart(sc));
    out
}

fn table_html(s: &Section) -> String {
    let mut out = format!(
        "<h3>{}</h3><p class=\"note\">{}</p>",
        esc(s.title),
        esc(s.note)
    );
    if s.rows.is_empty() {
        let _ = write!(out, "<p class=\"empty\">{}</p>", esc(s.empty));
        return out;
    }
    out.push_str("<table><thead><tr>");
    for h in &s.headers {
        let _ = write!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>");
    for r in &s.rows {
        out.push_str("<tr>");
        for (i, c) in r.iter().enumerate() {
            let free = s.as_lines && i + 1 == r.len();
            let class = if free { " class=\"free\"" } else { "" };
            let _ = write!(out, "<td{class}>{}</td>", esc(c));
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
    out
}

fn page(ctx: &Context, heading: &[String], body: &str) -> String {
    let mut out = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\
         <title>polygw report</title><style>{STYLE}</style></head><body>\
         <h1>polygw report</h1>"
    );
    for l in heading {
        let _ = write!(out, "<p class=\"meta\">{}</p>", esc(l));
    }
    let _ = write!(
        out,
        "<p class=\"meta\">Generated: {}</p>",
        esc(&iso(ctx.generated_ms))
    );
    out.push_str(body);
    out.push_str(
        "<footer>Self-contained: inline CSS and SVG only; no script, stylesheet, font or \
         image is loaded from anywhere. Definitions: docs/REPORT.md.</footer></body></html>\n",
    );
    out
}

/// The HTML report.
pub(crate) fn render(
    sum: &Summary,
    sc: &Scatter,
    timelines: &[CallTimeline],
    ctx: &Context,
) -> String {
    let mut body = String::new();
    let _ = write!(body, "<p><strong>{}</strong></p>", esc(&gap_line(sum, ctx)));
    body.push_str("<h2>Charts</h2>");
    body.push_str(&charts(sum, sc));
    body.push_str(&key_chart(sum));
    let note = format!(
        "The legs of the {} slowest calls (at most {MAX_TIMELINE_CALLS}) by their decision \
         trace (SPEC §19.4), on one time axis: ms since each call's start. {} of {} calls \
         carry a trace{}. polygw report --call ID prints one's rows and timeline.",
        timelines.len(),
        sum.traced_calls,
        sum.calls,
        if sum.unreadable_traces > 0 {
            format!(" ({} unreadable)", sum.unreadable_traces)
        } else {
            String::new()
        }
    );
    body.push_str(&timeline_chart(
        "Slowest calls: legs over time",
        &note,
        timelines,
    ));
    body.push_str("<h2>Tables</h2>");
    for s in sections(sum) {
        body.push_str(&table_html(&s));
    }
    page(ctx, &heading_lines(sum, ctx), &body)
}

/// The page of `polygw report --call ID --html FILE`: the call's rows, its legs as a
/// timeline chart, and the trace's timeline as text.
pub(crate) fn render_call(view: &CallView) -> String {
    let mut body = String::new();
    let (headers, rows) = view.table();
    body.push_str(&table_html(&Section {
        title: "Rows",
        note: "The call's telemetry rows: attempts in attempt order, then the others.",
        headers,
        rows,
        empty: "no row",
        as_lines: false,
    }));
    let timelines: Vec<CallTimeline> = view.timeline().into_iter().collect();
    body.push_str(&timeline_chart(
        "Legs over time",
        "Each leg from its launch to its end, ms since the call's start (SPEC §19.4).",
        &timelines,
    ));
    if let Traced::Trace(trace, row) = view.traced() {
        let _ = write!(
            body,
            "<h3>Timeline</h3><p class=\"note\">The decision trace on row {}; ms since the \
             call's start.</p><pre id=\"call-trace\">",
            esc(&row)
        );
        for l in trace.timeline() {
            let _ = writeln!(body, "{}", esc(&l));
        }
        body.push_str("</pre>");
    }
    let ctx = Context {
        db: view.db.clone(),
        since: None,
        scope: None,
        generated_ms: view.generated_ms,
        db_gap: 0,
        prices: String::new(),
    };
    page(&ctx, &view.heading(), &body)
}

/// Known cost per client key (SPEC §21.1), when any row names a key.
fn key_chart(sum: &Summary) -> String {
    if sum.keys.is_empty() {
        return String::new();
    }
    BarChart {
        title: "Known cost per client key".into(),
        note: "Sum of the known costs of the attempts and cache hits charged to each key; the \
               note gives its calls and the rows whose cost is unknown (not in the bar)."
            .into(),
        series: vec![("known cost".into(), PALETTE[4])],
        cats: sum
            .keys
            .iter()
            .map(|k| match (&k.id, k.name.as_str()) {
                (Some(id), "") => id.clone(),
                (Some(id), name) => format!("{id} ({name})"),
                (None, _) => NO_KEY.to_string(),
            })
            .collect(),
        values: sum.keys.iter().map(|k| vec![k.cost.known_sum()]).collect(),
        stacked: false,
        fmt: money_fmt,
        max: None,
        notes: sum
            .keys
            .iter()
            .map(|k| format!("{} calls, unknown: {}", k.calls, k.cost.unknown_rows))
            .collect(),
    }
    .render()
}

/// A leg's colour by how it ended.
fn leg_colour(e: &LegEnd) -> &'static str {
    match e {
        LegEnd::Won => OK_COLOUR,
        LegEnd::Failed(_) => FAILED_COLOUR,
        LegEnd::Cancelled(_) => "#bab0ac",
        LegEnd::Ended => "#76b7b2",
        LegEnd::Unknown => "#4e79a7",
    }
}

/// The legend's outcome entries.
const LEG_LEGEND: [(&str, &str); 5] = [
    ("won", OK_COLOUR),
    ("failed", FAILED_COLOUR),
    ("cancelled", "#bab0ac"),
    ("ended, not the answer", "#76b7b2"),
    ("end unknown", "#4e79a7"),
];

const MARK_DARK: &str = "#222";
const STALL_COLOUR: &str = "#f28e2b";
const RESUME_COLOUR: &str = "#b07aa1";
const END_COLOUR: &str = "#8b0000";

/// The SVG of one mark centred on (`x`, `y`) (a bar's middle), `class` `mark mark-KIND`,
/// with its tooltip.
fn mark(kind: &str, x: f64, y: f64, title: &str) -> String {
    let t = format!("<title>{}</title>", esc(title));
    let (x_, y_) = (n(x), n(y));
    match kind {
        "first-token" => format!(
            "<circle class=\"mark mark-first-token\" cx=\"{x_}\" cy=\"{y_}\" r=\"3\" \
             fill=\"#fff\" stroke=\"{MARK_DARK}\" stroke-width=\"1.2\">{t}</circle>"
        ),
        "commit" => format!(
            "<rect class=\"mark mark-commit\" x=\"{}\" y=\"{}\" width=\"2\" height=\"14\" \
             fill=\"{MARK_DARK}\">{t}</rect>",
            n(x - 1.0),
            n(y - 7.0)
        ),
        "stall" => format!(
            "<path class=\"mark mark-stall\" d=\"M{} {}L{} {}L{x_} {}Z\" fill=\"{STALL_COLOUR}\" \
             stroke=\"{MARK_DARK}\" stroke-width=\"0.5\">{t}</path>",
            n(x - 4.5),
            n(y - 10.0),
            n(x + 4.5),
            n(y - 10.0),
            n(y - 3.0)
        ),
        "resume" => format!(
            "<path class=\"mark mark-resume\" d=\"M{x_} {}L{} {y_}L{x_} {}Z\" \
             fill=\"{RESUME_COLOUR}\" stroke=\"{MARK_DARK}\" stroke-width=\"0.5\">{t}</path>",
            n(y - 6.0),
            n(x + 7.0),
            n(y + 6.0)
        ),
        "cancel" => format!(
            "<path class=\"mark mark-cancel\" d=\"M{} {}L{} {}M{} {}L{} {}\" stroke=\"{MARK_DARK}\" \
             stroke-width=\"1.6\" fill=\"none\">{t}</path>",
            n(x - 4.0),
            n(y - 4.0),
            n(x + 4.0),
            n(y + 4.0),
            n(x - 4.0),
            n(y + 4.0),
            n(x + 4.0),
            n(y - 4.0)
        ),
        "fail" => format!(
            "<rect class=\"mark mark-fail\" x=\"{}\" y=\"{}\" width=\"3\" height=\"14\" \
             fill=\"{END_COLOUR}\">{t}</rect>",
            n(x - 1.5),
            n(y - 7.0)
        ),
        // "won"
        _ => format!(
            "<path class=\"mark mark-won\" d=\"M{x_} {}L{} {y_}L{x_} {}L{} {y_}Z\" \
             fill=\"#1b5e20\" stroke=\"#fff\" stroke-width=\"0.8\">{t}</path>",
            n(y - 6.0),
            n(x + 6.0),
            n(y + 6.0),
            n(x - 6.0)
        ),
    }
}

/// A leg's tooltip.
fn leg_title(call: &CallTimeline, l: &LegSpan) -> String {
    let mut t = format!(
        "{} — {}: launched at {} ms, {} at {} ms{}",
        call.logical_call_id,
        l.label(),
        l.start,
        l.outcome.text(),
        l.end,
        if l.end_known {
            ""
        } else {
            " (the trace's last event)"
        }
    );
    if let Some(r) = &l.row {
        let _ = write!(
            t,
            "; row {}: latency {}, TTFT {}, stalls {}, tokens {}, cost {}",
            r.call_id,
            ms(r.latency_ms.map(|v| v as f64)),
            ms(r.ttft_ms.map(|v| v as f64)),
            r.stall_count
                .map_or_else(|| "—".to_string(), |n| n.to_string()),
            r.tokens,
            money(r.cost)
        );
    }
    t
}

/// The timeline chart (SPEC §19.4): per call, a heading line and one horizontal bar per
/// leg from its launch to its end, coloured by how it ended, with marks for its first
/// token, commit, stalls that fired the stall trigger, a resume leg's start, and its
/// cancel, failure or win; a failed call's end and later rounds' starts as dashed lines.
/// One time axis for all calls. `<svg id="call-timelines">`, one `rect.leg` per leg.
fn timeline_chart(title: &str, note: &str, calls: &[CallTimeline]) -> String {
    let mut out = format!(
        "<figure id=\"call-timelines-figure\"><figcaption>{}</figcaption><p class=\"note\">{}\
         </p>",
        esc(title),
        esc(note)
    );
    if calls.is_empty() {
        out.push_str("<p class=\"empty\">no call with a decision trace</p></figure>");
        return out;
    }
    const CALL_H: f64 = 22.0;
    const LEG_H: f64 = 18.0;
    const BAR_H: f64 = 10.0;
    const GAP: f64 = 10.0;
    let (x0, x1) = (300.0, WIDTH - 24.0);
    let max = calls.iter().map(|c| c.duration).max().unwrap_or(0).max(1) as f64;
    let step = nice_step(max, 6.0);
    let axis_max = (max / step).ceil() * step;
    let xs = |t: u64| x0 + (t as f64 / axis_max) * (x1 - x0);
    let top = 74.0;
    let plot_h: f64 = calls
        .iter()
        .map(|c| CALL_H + c.legs.len() as f64 * LEG_H + GAP)
        .sum();
    let height = top + plot_h + 8.0;
    let _ = write!(
        out,
        "<svg id=\"call-timelines\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" \
         role=\"img\" aria-label=\"{}\" data-calls=\"{}\" data-legs=\"{}\">",
        esc(title),
        calls.len(),
        calls.iter().map(|c| c.legs.len()).sum::<usize>(),
        w = n(WIDTH),
        h = n(height)
    );
    // Legend: outcomes, then marks.
    out.push_str("<g class=\"legend\">");
    let mut lx = 8.0;
    for (name, colour) in LEG_LEGEND {
        let _ = write!(
            out,
            "<rect x=\"{}\" y=\"8\" width=\"14\" height=\"{BAR_H}\" fill=\"{colour}\"/>\
             <text x=\"{}\" y=\"17\">{}</text>",
            n(lx),
            n(lx + 18.0),
            esc(name)
        );
        lx += 18.0 + name.chars().count() as f64 * 6.2 + 18.0;
    }
    let marks = [
        ("first-token", "first token"),
        ("commit", "commit"),
        ("stall", "stall (fired a leg)"),
        ("resume", "resume leg"),
        ("cancel", "cancelled"),
        ("fail", "failed"),
        ("won", "won"),
    ];
    let mut lx = 14.0;
    for (kind, name) in marks {
        out.push_str(&mark(kind, lx, 36.0, name));
        let _ = write!(
            out,
            "<text x=\"{}\" y=\"40\">{}</text>",
            n(lx + 10.0),
            esc(name)
        );
        lx += 10.0 + name.chars().count() as f64 * 6.2 + 20.0;
    }
    let _ = write!(
        out,
        "<line x1=\"{}\" y1=\"36\" x2=\"{}\" y2=\"36\" stroke=\"{END_COLOUR}\" \
         stroke-dasharray=\"3 2\"/><text x=\"{}\" y=\"40\">call failed</text>",
        n(lx),
        n(lx + 16.0),
        n(lx + 20.0)
    );
    out.push_str("</g>");
    // Time axis.
    let mut t = 0.0;
    while t <= axis_max * (1.0 + 1e-9) {
        let x = n(x0 + (t / axis_max) * (x1 - x0));
        let _ = write!(
            out,
            "<line class=\"ax\" x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\"/>\
             <text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            n(top - 8.0),
            n(top + plot_h),
            n(top - 12.0),
            esc(&ms(Some(t)))
        );
        t += step;
    }
    let mut y = top;
    for (i, c) in calls.iter().enumerate() {
        let group_h = CALL_H + c.legs.len() as f64 * LEG_H;
        let _ = write!(
            out,
            "<g class=\"call\" data-call=\"{}\">",
            esc(&c.logical_call_id)
        );
        let dropped = if c.dropped > 0 {
            format!(" · {} trace events not kept", c.dropped)
        } else {
            String::new()
        };
        let _ = write!(
            out,
            "<text class=\"call\" x=\"4\" y=\"{}\">{}<title>{}</title></text>",
            n(y + 15.0),
            esc(&format!(
                "{}. {} · {} · {} · {}{dropped}",
                i + 1,
                c.scope,
                c.logical_call_id,
                ms(Some(c.duration as f64)),
                c.outcome()
            )),
            esc(&c.logical_call_id)
        );
        // Later rounds' starts.
        for r in c.rounds.iter().filter(|r| r.n > 1) {
            let x = n(xs(r.t));
            let _ = write!(
                out,
                "<line class=\"round\" x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\" \
                 stroke=\"#999\" stroke-dasharray=\"2 3\"><title>round {} at {} ms</title></line>",
                n(y + CALL_H - 2.0),
                n(y + group_h),
                r.n,
                r.t
            );
        }
        for (j, l) in c.legs.iter().enumerate() {
            let ly = y + CALL_H + j as f64 * LEG_H;
            let mid = ly + LEG_H / 2.0;
            let label = l.label();
            let _ = write!(
                out,
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}<title>{}</title></text>",
                n(x0 - 8.0),
                n(mid + 4.0),
                esc(&short(&label)),
                esc(&label)
            );
            let (bx, bw) = (xs(l.start), (xs(l.end) - xs(l.start)).max(1.5));
            let _ = write!(
                out,
                "<rect class=\"leg leg-{}\" data-leg=\"r{}.{}\" x=\"{}\" y=\"{}\" \
                 width=\"{}\" height=\"{BAR_H}\" fill=\"{}\"{}><title>{}</title></rect>",
                l.outcome.class(),
                l.round,
                l.leg,
                n(bx),
                n(mid - BAR_H / 2.0),
                n(bw),
                leg_colour(&l.outcome),
                if l.end_known {
                    ""
                } else {
                    " fill-opacity=\"0.5\""
                },
                esc(&leg_title(c, l))
            );
            if l.why == "resume" {
                out.push_str(&mark(
                    "resume",
                    xs(l.start),
                    mid,
                    &format!(
                        "{}: resume leg launched at {} ms{}",
                        label,
                        l.start,
                        l.mode
                            .as_deref()
                            .map(|m| format!(" (by {m})"))
                            .unwrap_or_default()
                    ),
                ));
            }
            if let Some(t) = l.first_token {
                out.push_str(&mark(
                    "first-token",
                    xs(t),
                    mid,
                    &format!("{label}: first token at {t} ms"),
                ));
            }
            if let Some(t) = l.commit {
                out.push_str(&mark(
                    "commit",
                    xs(t),
                    mid,
                    &format!("{label}: committed at {t} ms (its chunks reach the caller)"),
                ));
            }
            for t in &l.stalls {
                out.push_str(&mark(
                    "stall",
                    xs(*t),
                    mid,
                    &format!("{label}: stalled; the stall trigger fired at {t} ms"),
                ));
            }
            let end = match &l.outcome {
                LegEnd::Won => Some("won"),
                LegEnd::Cancelled(_) => Some("cancel"),
                LegEnd::Failed(_) => Some("fail"),
                LegEnd::Ended | LegEnd::Unknown => None,
            };
            if let Some(kind) = end {
                out.push_str(&mark(
                    kind,
                    xs(l.end),
                    mid,
                    &format!("{label}: {} at {} ms", l.outcome.text(), l.end),
                ));
            }
        }
        if let Some((t, why)) = &c.end {
            let x = n(xs(*t));
            let _ = write!(
                out,
                "<line class=\"mark mark-end\" x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\" \
                 stroke=\"{END_COLOUR}\" stroke-width=\"1.5\" stroke-dasharray=\"3 2\">\
                 <title>{}</title></line>",
                n(y + CALL_H - 2.0),
                n(y + group_h),
                esc(&format!("the call failed at {t} ms: {why}"))
            );
        }
        out.push_str("</g>");
        y += group_h + GAP;
    }
    out.push_str("</svg></figure>");
    out
}

/// The HTML file when there is no row.
pub(crate) fn render_empty(ctx: &Context, message: &str) -> String {
    page(
        ctx,
        &[format!("Database: {}", ctx.db)],
        &format!("<p class=\"empty\">{}</p>", esc(message)),
    )
}

#[cfg(test)]
mod tests {
    use super::super::stats::tests::{fixture, keyed_fixture};
    use super::super::stats::{scatter, summarize};
    use super::super::timeline::timelines_of;
    use super::*;

    fn ctx() -> Context {
        Context {
            db: "postgres://u:***@h/db?***".into(),
            since: None,
            scope: None,
            generated_ms: 0,
            db_gap: 5,
            prices: "none".into(),
        }
    }

    /// No attribute or CSS construct that loads anything.
    fn assert_self_contained(doc: &str) {
        for bad in [
            "<script",
            "<link",
            "<img",
            "<iframe",
            "<object",
            "<embed",
            " src=",
            " href=",
            "url(",
            "@import",
            "@font-face",
            "http://",
            "https://",
        ] {
            assert!(!doc.contains(bad), "found {bad:?}");
        }
    }

    #[test]
    fn escapes_text() {
        assert_eq!(
            esc(r#"<a href="x">&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(esc("plain-0"), "plain-0");
        assert_eq!(short("a-0"), "a-0");
        let long = "x".repeat(50);
        assert_eq!(short(&long).chars().count(), LABEL_CHARS);
        assert!(short(&long).ends_with('…'));
    }

    #[test]
    fn data_is_escaped_everywhere() {
        let mut rows = fixture();
        rows[1].source = Some("<script>alert(1)</script>".into());
        rows[0].error = Some("x\"><img src=y>".into());
        rows[5].error_detail = Some("<b>bold</b> & 'quoted'".into());
        let sum = summarize(&rows);
        let doc = render(&sum, &scatter(&rows, 100), &[], &ctx());
        assert!(!doc.contains("<script>alert"));
        assert!(doc.contains("LLM/&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(doc.contains("x&quot;&gt;&lt;img src=y&gt;"));
        assert!(doc.contains("&lt;b&gt;bold&lt;/b&gt; &amp; &#39;quoted&#39;"));
        assert!(!doc.contains("<b>bold"));
        assert_self_contained(&doc.replace(" src=y", ""));
    }

    #[test]
    fn the_document_has_every_chart_and_table() {
        let rows = fixture();
        let sum = summarize(&rows);
        let doc = render(&sum, &scatter(&rows, 5_000), &[], &ctx());
        assert!(doc.starts_with("<!DOCTYPE html>"));
        assert!(doc.trim_end().ends_with("</html>"));
        assert_self_contained(&doc);
        for want in [
            "Attempt latency per source",
            "Time to first token per source",
            "Stall share per source",
            "Failed attempts by error label",
            "Hedging per scope",
            "Hedge legs per source",
            "Tokens per source",
            "Known cost per source",
            "Attempt latency over time",
            "All 8 attempts",
            "Accounting gap: 5 attempts",
            "<table>",
            "<th>stall share</th>",
            "LLM/a-0",
            "Database: postgres://u:***@h/db?***",
        ] {
            assert!(doc.contains(want), "missing {want:?}");
        }
        // 8 charts + the scatter.
        assert_eq!(doc.matches("<svg").count(), 9);
        assert_eq!(doc.matches("<svg").count(), doc.matches("</svg>").count());
        // One circle per attempt plus the two legend dots.
        assert_eq!(doc.matches("<circle").count(), 8 + 2);
    }

    #[test]
    fn the_slowest_calls_are_a_timeline_chart_and_keys_have_their_spend() {
        let rows = keyed_fixture();
        let sum = summarize(&rows);
        let ids: Vec<String> = sum
            .slowest
            .iter()
            .map(|c| c.logical_call_id.clone())
            .collect();
        let tl = timelines_of(&rows, &ids);
        let doc = render(&sum, &scatter(&rows, 100), &tl, &ctx());
        assert_self_contained(&doc);
        assert!(doc.contains("<svg id=\"call-timelines\""), "the chart");
        assert!(doc.contains("data-calls=\"1\" data-legs=\"2\""));
        assert!(doc.contains("<g class=\"call\" data-call=\"c1\">"));
        assert_eq!(doc.matches("class=\"leg leg-").count(), 2);
        assert_eq!(doc.matches("class=\"leg leg-won\"").count(), 1);
        assert_eq!(doc.matches("class=\"leg leg-cancelled\"").count(), 1);
        // One of each mark in the legend, plus the call's.
        for (kind, n) in [
            ("first-token", 2),
            ("commit", 2),
            ("stall", 1),
            ("resume", 1),
            ("cancel", 1),
            ("won", 1),
            ("fail", 0),
        ] {
            let class = format!("class=\"mark mark-{kind}\"");
            assert_eq!(doc.matches(&class).count(), n + 1, "{kind}");
        }
        assert!(doc.contains("1 of 6 calls carry a trace"), "the note");
        assert!(doc.contains("Known cost per client key"));
        assert!(doc.contains("<h3>Spend per client key</h3>"));
        assert!(doc.contains("<h3>Slowest calls</h3>"));
        // 8 charts + the scatter + the keys' cost + the timeline.
        assert_eq!(doc.matches("<svg").count(), 11);
        assert_eq!(doc.matches("<svg").count(), doc.matches("</svg>").count());
        assert!(doc.contains("Content-Security-Policy"));
    }

    #[test]
    fn a_timeline_escapes_the_data() {
        use polygw::core::trace::{CallTrace, TraceEntry, TraceEvent};
        let trace = CallTrace {
            events: vec![
                TraceEntry {
                    t: 0,
                    event: TraceEvent::Launch {
                        leg: 0,
                        src: "<script>alert(1)</script>".into(),
                        why: "primary".into(),
                        by: None,
                        mode: None,
                        of: None,
                        thr_ms: None,
                        silent_ms: None,
                        late: None,
                    },
                },
                TraceEntry {
                    t: 5,
                    event: TraceEvent::Fail {
                        leg: 0,
                        why: "<b>x</b>".into(),
                    },
                },
                TraceEntry {
                    t: 6,
                    event: TraceEvent::End {
                        why: "\"><img src=y>".into(),
                    },
                },
            ],
            dropped: 0,
        };
        let mut r = fixture()[6].clone();
        r.logical_call_id = "c\"<x>&'".into();
        r.trace = Some(trace.to_json());
        let rows = vec![r];
        let sum = summarize(&rows);
        let tl = timelines_of(&rows, &[rows[0].logical_call_id.clone()]);
        assert_eq!(tl.len(), 1);
        let doc = render(&sum, &scatter(&rows, 100), &tl, &ctx());
        assert!(!doc.contains("<script>alert"));
        assert!(!doc.contains("<b>x"));
        assert!(!doc.contains("<img"));
        assert!(doc.contains("data-call=\"c&quot;&lt;x&gt;&amp;&#39;\""));
        assert!(doc.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(doc.contains("class=\"mark mark-end\""));
        assert_self_contained(&doc.replace(" src=y", ""));
    }

    #[test]
    fn a_big_scatter_is_thinned_and_says_so() {
        let mut rows = Vec::new();
        for i in 0..12_000u64 {
            let mut r = fixture()[2].clone();
            r.call_id = format!("a{i}");
            r.created_at_ms = i as i64 * 1_000;
            r.latency_ms = Some(100 + i % 5_000);
            rows.push(r);
        }
        let sc = scatter(&rows, MAX_SCATTER_POINTS);
        let svg = scatter_chart(&sc);
        assert!(svg.matches("<circle").count() <= MAX_SCATTER_POINTS + 2);
        assert!(
            svg.contains("4000 of 12000 attempts shown (1 in 3 of"),
            "{}",
            &svg[..400]
        );
        assert!(svg.len() < 300_000, "{} bytes", svg.len());
    }

    #[test]
    fn ticks_and_empty_charts() {
        assert_eq!(nice_step(1.0, 5.0), 0.2);
        assert_eq!(nice_step(4_000.0, 5.0), 1_000.0);
        assert_eq!(nice_step(0.0, 5.0), 1.0);
        let chart = BarChart {
            title: "t".into(),
            note: String::new(),
            series: vec![("s".into(), PALETTE[0])],
            cats: vec!["a".into()],
            values: vec![vec![None]],
            stacked: false,
            fmt: plain,
            max: None,
            notes: Vec::new(),
        };
        assert!(chart.render().contains("no data"));
        let empty = render_empty(&ctx(), "No telemetry rows in x: nothing to report.");
        assert!(empty.contains("nothing to report"));
        assert_self_contained(&empty);
    }
}
