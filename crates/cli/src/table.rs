//! Plain-text tables for the terminal: aligned columns, numbers right-aligned.

/// A table of strings with a header row.
#[derive(Debug, Clone, Default)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new<S: Into<String>>(headers: impl IntoIterator<Item = S>) -> Self {
        Table {
            headers: headers.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (missing cells are empty, extra ones ignored).
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) -> &mut Self {
        let mut r: Vec<String> = cells.into_iter().map(Into::into).collect();
        r.resize(self.headers.len(), String::new());
        self.rows.push(r);
        self
    }

    /// Whether there is no row.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text: the first column left-aligned, the others right-aligned.
    pub fn render(&self) -> String {
        let n = self.headers.len();
        let width = |i: usize| {
            self.rows
                .iter()
                .map(|r| r[i].chars().count())
                .chain(std::iter::once(self.headers[i].chars().count()))
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..n).map(width).collect();
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let pad = widths[i].saturating_sub(c.chars().count());
                if i > 0 {
                    s.push_str("  ");
                }
                if i == 0 {
                    s.push_str(c);
                    s.push_str(&" ".repeat(pad));
                } else {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                }
            }
            s.trim_end().to_string()
        };
        let mut out = line(&self.headers);
        out.push('\n');
        let total: usize = widths.iter().sum::<usize>() + 2 * n.saturating_sub(1);
        out.push_str(&"-".repeat(total));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }
}

/// A millisecond figure for a table ("—" when unknown).
pub fn ms(v: Option<f64>) -> String {
    match v {
        Some(x) if x >= 10_000.0 => format!("{:.1} s", x / 1000.0),
        Some(x) => format!("{x:.0} ms"),
        None => "—".into(),
    }
}

/// A percentage ("—" when unknown).
pub fn pct(v: Option<f64>) -> String {
    match v {
        Some(x) => format!("{:.1} %", x * 100.0),
        None => "—".into(),
    }
}

/// A cost ("unknown" when NULL, never 0 for unknown).
pub fn money(v: Option<f64>) -> String {
    match v {
        Some(x) => format!("{x:.6}"),
        None => "unknown".into(),
    }
}

/// The `q`-quantile (0..=1) of values (nearest rank), `None` when empty.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_aligned() {
        let mut t = Table::new(["source", "p50"]);
        t.row(["a-0", "12 ms"]).row(["long-name-1", "3 ms"]);
        let s = t.render();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "source         p50");
        assert_eq!(lines[2], "a-0          12 ms");
        assert_eq!(lines[3], "long-name-1   3 ms");
    }

    #[test]
    fn quantiles_and_formats() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), Some(50.0));
        assert_eq!(quantile(&v, 0.99), Some(99.0));
        assert_eq!(quantile(&v, 1.0), Some(100.0));
        assert_eq!(quantile(&[], 0.5), None);
        assert_eq!(money(None), "unknown");
        assert_eq!(pct(Some(0.25)), "25.0 %");
        assert_eq!(ms(Some(12_345.0)), "12.3 s");
    }
}
