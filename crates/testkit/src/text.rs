//! Reading the text tables the CLI prints (`polygw report`), for tests.

/// The cells of the first line of `text` starting with `prefix` after the heading
/// `title` (cells are separated by two or more spaces).
pub fn cells(text: &str, title: &str, prefix: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| *l != title)
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} under {title:?} in\n{text}"))
        .split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect()
}
