//! The `--html` output of `polygw report`: one self-contained HTML file (inline CSS, inline
//! SVG charts drawn here, no script, no font, no external resource), every piece of data
//! escaped.

use std::fmt::Write as _;

use super::stats::{error_labels, Scatter, Summary};
use super::{gap_line, heading_lines, iso, sections, Context, Section, MAX_SCATTER_POINTS};
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
svg .ax{stroke:#ccc;stroke-width:1}svg .lbl{font-size:12px}footer{margin-top:32px;color:#888;font-size:12px}";

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
pub(crate) fn render(sum: &Summary, sc: &Scatter, ctx: &Context) -> String {
    let mut body = String::new();
    let _ = write!(body, "<p><strong>{}</strong></p>", esc(&gap_line(sum, ctx)));
    body.push_str("<h2>Charts</h2>");
    body.push_str(&charts(sum, sc));
    body.push_str("<h2>Tables</h2>");
    for s in sections(sum) {
        body.push_str(&table_html(&s));
    }
    page(ctx, &heading_lines(sum, ctx), &body)
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
    use super::super::stats::tests::fixture;
    use super::super::stats::{scatter, summarize};
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
        let doc = render(&sum, &scatter(&rows, 100), &ctx());
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
        let doc = render(&sum, &scatter(&rows, 5_000), &ctx());
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
