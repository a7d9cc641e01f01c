//! Rendering of a [`Comparison`]: the human table for stdout and the Markdown
//! summary for CI job pages (the JSON verdict is the serialized
//! `Comparison`). Pure string building; no I/O.

use std::fmt::Write;

use super::gate::fmt_p;
use crate::score::paired::PairedStats;
use super::{Comparison, MovedWindow, RunInfo};

fn describe(r: &RunInfo) -> String {
    let mut parts = vec![r.artifact.clone()];
    if !r.backend.is_empty() {
        parts.push(format!("backend {}", r.backend));
    }
    if !r.kv_dtype.is_empty() {
        parts.push(format!("kv {}", r.kv_dtype));
    }
    parts.push(format!("prefill {}", r.prefill_chunk_tokens));
    parts.retain(|p| !p.is_empty());
    format!("{} ({})", r.path.display(), parts.join(", "))
}

fn ci(s: &PairedStats) -> String {
    s.ppl_change_ci95_pct.map_or("-".to_string(), |[lo, hi]| format!("[{lo:+.4}, {hi:+.4}]"))
}

fn p_t(s: &PairedStats) -> String {
    s.p_t.map_or("-".to_string(), fmt_p)
}

/// Scope rows: every domain, then `overall`.
fn rows(c: &Comparison) -> Vec<(&str, &PairedStats)> {
    let mut v: Vec<(&str, &PairedStats)> = c.domains.iter().map(|d| (d.domain.as_str(), &d.stats)).collect();
    v.push(("overall", &c.overall));
    v
}

fn window_label(w: &MovedWindow) -> String {
    format!("tokens [{}, {})", w.first_target, w.end)
}

/// The stdout table.
pub fn table(c: &Comparison) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "BASE {}", describe(&c.base));
    let _ = writeln!(o, "NEW  {}", describe(&c.new));
    let _ = writeln!(
        o,
        "{} windows paired over {} stream(s), {} scored tokens ({} method, context {})",
        c.overall.n_windows, c.n_streams, c.overall.scored_tokens, c.base.method, c.base.context
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<16} {:>7} {:>9} {:>11} {:>11} {:>9} {:>22} {:>9} {:>12} {:>9}",
        "scope", "windows", "scored", "base_ppl", "new_ppl", "dPPL%", "95% CI dPPL%", "p(t)", "worse/better", "p(sign)"
    );
    for (name, s) in rows(c) {
        let _ = writeln!(
            o,
            "{:<16} {:>7} {:>9} {:>11.4} {:>11.4} {:>+9.4} {:>22} {:>9} {:>12} {:>9}",
            name,
            s.n_windows,
            s.scored_tokens,
            s.base_perplexity,
            s.new_perplexity,
            s.ppl_change_pct,
            ci(s),
            p_t(s),
            format!("{}/{}", s.n_worse, s.n_better),
            fmt_p(s.p_sign)
        );
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "checks:");
    for ch in &c.checks {
        let _ = writeln!(o, "  {:<4}  {:<12} {:<14} {}", ch.status.name(), ch.name, ch.scope, ch.detail);
    }
    for n in &c.notes {
        let _ = writeln!(o, "  note: {n}");
    }
    let _ = writeln!(o);
    if c.top_windows.is_empty() {
        let _ = writeln!(o, "no window moved");
    } else {
        let _ = writeln!(o, "windows that moved most:");
        let _ = writeln!(o, "  {:>4}  {:<20} {:>6}  {:>14}  {:>22} {:>22}  text", "rank", "stream", "window", "dNLL (nats)", "dNLL/token", "scored");
        for w in &c.top_windows {
            let _ = writeln!(
                o,
                "  {:>4}  {:<20} {:>6}  {:>+14.6e}  {:>+22.6e} {:>22}  {}",
                w.rank,
                w.stream,
                w.index,
                w.dnll,
                w.dnll_per_token,
                window_label(w),
                w.excerpt.as_deref().unwrap_or("")
            );
        }
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "verdict: {} (exit {})", c.verdict.name(), c.exit_code);
    o
}

/// The Markdown summary.
pub fn markdown(c: &Comparison) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "## Quality gate: **{}**", c.verdict.name());
    let _ = writeln!(o);
    let _ = writeln!(o, "- BASE: `{}`", describe(&c.base));
    let _ = writeln!(o, "- NEW: `{}`", describe(&c.new));
    let _ = writeln!(
        o,
        "- {} windows over {} stream(s), {} scored tokens; PPL change {:+.4} % (95 % CI {}), paired t p = {}, sign test p = {}",
        c.overall.n_windows,
        c.n_streams,
        c.overall.scored_tokens,
        c.overall.ppl_change_pct,
        ci(&c.overall),
        p_t(&c.overall),
        fmt_p(c.overall.p_sign)
    );
    let _ = writeln!(o);
    let _ = writeln!(o, "| scope | windows | scored | base PPL | new PPL | dPPL % | 95 % CI dPPL % | p(t) | worse/better | p(sign) |");
    let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, s) in rows(c) {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {:.4} | {:.4} | {:+.4} | {} | {} | {}/{} | {} |",
            name,
            s.n_windows,
            s.scored_tokens,
            s.base_perplexity,
            s.new_perplexity,
            s.ppl_change_pct,
            ci(s),
            p_t(s),
            s.n_worse,
            s.n_better,
            fmt_p(s.p_sign)
        );
    }
    let _ = writeln!(o);
    let _ = writeln!(o, "| check | scope | result | detail |");
    let _ = writeln!(o, "|---|---|---|---|");
    for ch in &c.checks {
        let _ = writeln!(o, "| {} | {} | {} | {} |", ch.name, ch.scope, ch.status.name(), ch.detail.replace('|', "\\|"));
    }
    for n in &c.notes {
        let _ = writeln!(o, "\n> note: {n}");
    }
    if !c.top_windows.is_empty() {
        let _ = writeln!(o);
        let _ = writeln!(o, "<details><summary>Windows that moved most</summary>");
        let _ = writeln!(o);
        let _ = writeln!(o, "| # | stream | window | dNLL (nats) | dNLL/token | scored | text |");
        let _ = writeln!(o, "|---:|---|---:|---:|---:|---|---|");
        for w in &c.top_windows {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {:+.6e} | {:+.6e} | {} | {} |",
                w.rank,
                w.stream,
                w.index,
                w.dnll,
                w.dnll_per_token,
                window_label(w),
                w.excerpt.as_deref().map_or(String::new(), |e| format!("`{}`", e.replace('`', "'").replace('|', "\\|")))
            );
        }
        let _ = writeln!(o);
        let _ = writeln!(o, "</details>");
    }
    o
}
