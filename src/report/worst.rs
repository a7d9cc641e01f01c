//! Where a `--kl-reference` comparison moved most, for people: the decoded
//! text around each of the report's worst positions and windows, and
//! `worst.md` beside report.json.
//!
//! The lists themselves (which positions and windows, their figures) are
//! chosen while scoring (`score::kl::keep_worst`); this module only decodes
//! text and writes the Markdown file.

use std::fmt::Write;
use std::path::Path;

use anyhow::Result;

use super::KlReport;
use crate::text::tokenizer::TextTokenizer;

pub const WORST_FILE: &str = "worst.md";

/// Tokens of context decoded before and after the predicted token.
pub const TOKENS_BEFORE: usize = 24;
pub const TOKENS_AFTER: usize = 8;

/// The decoded text around `tokens[at]`: up to [`TOKENS_BEFORE`] tokens, the
/// token itself in `[[ ]]`, up to [`TOKENS_AFTER`] tokens; on one line
/// (newlines and tabs written `\n`, `\t`).
pub fn excerpt(tokenizer: &TextTokenizer, tokens: &[u32], at: usize) -> String {
    if at >= tokens.len() {
        return format!("<token {at} is past the stream's {} tokens>", tokens.len());
    }
    let before = tokenizer.decode(&tokens[at.saturating_sub(TOKENS_BEFORE)..at]);
    let target = tokenizer.decode(&tokens[at..at + 1]);
    let after = tokenizer.decode(&tokens[at + 1..(at + 1 + TOKENS_AFTER).min(tokens.len())]);
    let one_line = |s: &str| clip(s, usize::MAX);
    format!("{}[[{}]]{}", one_line(&before), one_line(&target), one_line(&after))
}

/// Fills the `text` of every worst position and window. `stream_tokens`
/// gives a stream's token ids by name.
pub fn add_excerpts<'a>(kl: &mut KlReport, tokenizer: &TextTokenizer, stream_tokens: impl Fn(&str) -> Option<&'a [u32]>) {
    for p in &mut kl.worst_positions {
        p.text = stream_tokens(&p.stream).map(|t| excerpt(tokenizer, t, p.token_index));
        p.reference_top_text = p.reference_top.iter().map(|&(id, _, _)| tokenizer.decode(&[id])).collect();
    }
    for w in &mut kl.worst_windows {
        w.text = stream_tokens(&w.stream).map(|t| excerpt(tokenizer, t, w.max_kl_token_index));
    }
}

/// Escapes text for a Markdown table cell.
fn cell(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '|' => out.push_str("\\|"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '*' | '_' | '`' | '\\' | '#' | '~' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// `worst.md`: the worst windows and positions as two tables, from the report alone.
pub fn markdown(kl: &KlReport, model: &str) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# Where the KL reference comparison moved most\n");
    let _ = writeln!(
        md,
        "Model `{}` against reference `{}` (records SHA-256 `{}`, top-{} ids). KL is a lower bound of KL(reference || this run) (the reference's top-k ids plus one bucket for the rest); nats. \
         In the text, the predicted token is in **[[ ]]**; `\\n` is a newline.\n",
        cell(model),
        cell(&kl.reference.path),
        kl.reference.sha256,
        kl.reference.top_k,
    );
    let _ = writeln!(
        md,
        "Overall: mean KL {:.6} over {} positions, top-1 agreement {:.3} %, mean NLL change {:+.6} nats.\n",
        kl.summary.mean,
        kl.summary.positions,
        100.0 * kl.summary.top1_agreement,
        kl.summary.mean_nll_delta
    );
    let _ = writeln!(md, "## The {} windows with the largest mean KL\n", kl.worst_windows.len());
    if kl.worst_windows.is_empty() {
        let _ = writeln!(md, "No window has a positive mean KL.\n");
    } else {
        let _ = writeln!(md, "| # | stream | window | tokens | mean KL | max KL | mean NLL change | text around the window's largest KL |");
        let _ = writeln!(md, "|---:|---|---:|---|---:|---:|---:|---|");
        for (i, w) in kl.worst_windows.iter().enumerate() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | [{}, {}) | {:.6} | {:.6} | {:+.6} | {} |",
                i + 1,
                cell(&w.stream),
                w.window,
                w.begin,
                w.end,
                w.mean_kl,
                w.max_kl,
                w.mean_nll_delta,
                cell(w.text.as_deref().unwrap_or("-"))
            );
        }
        md.push('\n');
    }
    let _ = writeln!(md, "## The {} positions with the largest KL\n", kl.worst_positions.len());
    if kl.worst_positions.is_empty() {
        let _ = writeln!(md, "No position has a positive KL.\n");
    } else {
        let _ = writeln!(
            md,
            "| # | KL | stream | window | token | context | NLL here | NLL reference | reference's top ids: p reference -> p here | text |"
        );
        let _ = writeln!(md, "|---:|---:|---|---:|---:|---:|---:|---:|---|---|");
        for (i, p) in kl.worst_positions.iter().enumerate() {
            let top: Vec<String> = p
                .reference_top
                .iter()
                .enumerate()
                .map(|(i, &(id, pr, q))| {
                    let piece = p.reference_top_text.get(i).cloned().unwrap_or_else(|| format!("id {id}"));
                    format!("`{}` {pr:.3} -> {q:.3}", clip(&piece, 20).replace('`', "'"))
                })
                .collect();
            let _ = writeln!(
                md,
                "| {} | {:.6} | {} | {} | {} | {} | {:.4} | {:.4} | {} | {} |",
                i + 1,
                p.kl,
                cell(&p.stream),
                p.window,
                p.token_index,
                p.n_context,
                p.nll,
                p.reference_nll,
                top.join(", ").replace('|', "\\|"),
                cell(p.text.as_deref().unwrap_or("-"))
            );
        }
    }
    md
}

/// Writes `dir/worst.md` atomically.
pub fn write_markdown(dir: &Path, md: &str) -> Result<()> {
    crate::util::fs::write_atomic(&dir.join(WORST_FILE), md.as_bytes())
}

/// The first `n` characters of `s` on one line (newlines and tabs shown as
/// `\n` and `\t`), with `...` when cut.
pub fn clip(s: &str, n: usize) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i == n {
            out.push_str("...");
            break;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_keeps_one_line() {
        assert_eq!(clip("a\nb\tc", 10), "a\\nb\\tc");
        assert_eq!(clip("héllo wörld", 5), "héllo...");
        assert_eq!(clip("a\u{7}b", 5), "a b");
    }

    #[test]
    fn cells_escape_markdown() {
        assert_eq!(cell("a|b <c> *d* `e`"), "a\\|b &lt;c&gt; \\*d\\* \\`e\\`");
    }
}
