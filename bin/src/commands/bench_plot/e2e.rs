//! The charts and tables of a `rewind bench e2e --json` result: per model, decode step time, tokens/s and roofline
//! fraction against batch, one line per form (spec: per kept count).

use anyhow::Result;

use super::draw::{color, Chart, HLine, Scale, Series, REFERENCE};
use super::inputs::{E2eModel, E2eReport, E2eStep};
use super::{cell, subtitle, Out};

/// The fraction of the roofline a step is expected to reach (the target line of the roofline chart).
const ROOFLINE_TARGET: f64 = 0.9;

/// What one line of a chart shows.
#[derive(Clone, Debug, PartialEq)]
enum Key {
    /// A plain form: `recurrent`, `replay`, `kv-only` (or another that is not `spec`).
    Plain(String),
    /// The spec form at window `t` with `kept` drafts kept.
    Spec { t: u64, kept: u64 },
}

impl Key {
    fn label(&self) -> String {
        match self {
            Key::Plain(f) => f.clone(),
            Key::Spec { t, kept } => format!("spec T={t} kept {kept}"),
        }
    }

    fn matches(&self, s: &E2eStep) -> bool {
        match self {
            Key::Plain(f) => s.form == *f,
            Key::Spec { t, kept } => s.form == "spec" && s.window == *t && s.kept == *kept,
        }
    }
}

/// The lines of a model's charts: the plain forms (recurrent, replay, kv-only first), then per spec window T the
/// kept counts 0, T − 1 and T (every kept count would be T + 1 nearly equal lines).
fn keys(steps: &[E2eStep]) -> Vec<Key> {
    let mut plain: Vec<&str> = Vec::new();
    for s in steps.iter().filter(|s| s.form != "spec") {
        if !plain.contains(&s.form.as_str()) {
            plain.push(&s.form);
        }
    }
    let rank = |f: &str| {
        ["recurrent", "replay", "kv-only"]
            .iter()
            .position(|&g| g == f)
            .unwrap_or(3)
    };
    plain.sort_by_key(|f| rank(f)); // stable: other forms keep their order of appearance
    let mut keys: Vec<Key> = plain.into_iter().map(|f| Key::Plain(f.to_string())).collect();
    let mut windows: Vec<u64> = steps.iter().filter(|s| s.form == "spec").map(|s| s.window).collect();
    windows.sort_unstable();
    windows.dedup();
    for t in windows {
        for kept in [0, t.saturating_sub(1), t] {
            let key = Key::Spec { t, kept };
            if !keys.contains(&key) && steps.iter().any(|s| key.matches(s)) {
                keys.push(key);
            }
        }
    }
    keys
}

/// The (batch, value) points of `key`.
fn points(steps: &[E2eStep], key: &Key, value: impl Fn(&E2eStep) -> Option<f64>) -> Vec<(f64, f64)> {
    steps
        .iter()
        .filter(|s| key.matches(s))
        .filter_map(|s| Some((s.batch as f64, value(s)?)))
        .collect()
}

/// Writes the section of one e2e result: per model three charts and the table of its steps.
pub fn section(out: &mut Out, r: &E2eReport) -> Result<()> {
    if r.models.is_empty() {
        out.md.push(String::new());
        out.md.push("_No model in this result._".into());
    }
    for m in &r.models {
        model(out, r, m)?;
    }
    Ok(())
}

fn model(out: &mut Out, r: &E2eReport, m: &E2eModel) -> Result<()> {
    out.md.push(String::new());
    out.md.push(format!("### {}", m.name));
    if let Some(s) = &m.summary {
        out.md.push(String::new());
        out.md.push(s.clone());
    }
    if m.steps.is_empty() {
        // No chart to draw; the note says why rather than three "not drawn" lines.
        out.md.push(String::new());
        out.md.push("_No decode step measured: no chart._".into());
        table(out, m);
        return Ok(());
    }
    let keys = keys(&m.steps);
    let sub = subtitle(&r.header, r.dtype.as_deref());
    let chart = |what: &str, y_desc: &str, y_scale: Scale| Chart {
        title: format!("{}: {what}", m.name),
        subtitle: sub.clone(),
        x_desc: "batch (sequences per step, log2)".into(),
        y_desc: y_desc.into(),
        x_scale: Scale::Log2,
        y_scale,
        series: Vec::new(),
        hlines: Vec::new(),
        y_include: Vec::new(),
    };
    let line = |i: usize, key: &Key, value: &dyn Fn(&E2eStep) -> Option<f64>| Series {
        label: key.label(),
        color: color(i),
        dashed: false,
        points: points(&m.steps, key, value),
    };

    let mut step = chart("decode step time", "step time (ms, log)", Scale::Log10);
    step.series = keys
        .iter()
        .enumerate()
        .map(|(i, k)| line(i, k, &|s| s.step_ms))
        .collect();
    // Each form's roofline in its colour, dashed; spec once per window (the kept counts share one byte model
    // closely enough that three dashed lines would only add clutter).
    let mut spec_roofs: Vec<u64> = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let p = points(&m.steps, k, |s| s.roofline_ms);
        let label = match k {
            Key::Plain(f) => format!("{f} roofline"),
            Key::Spec { t, .. } if !spec_roofs.contains(t) && !p.is_empty() => {
                spec_roofs.push(*t);
                format!("spec T={t} roofline")
            }
            Key::Spec { .. } => continue,
        };
        step.series.push(Series {
            label,
            color: color(i),
            dashed: true,
            points: p,
        });
    }
    out.plot(&format!("e2e-{}-step-ms", m.name), step)?;

    let mut tokens = chart("decode throughput", "tokens/s (log)", Scale::Log10);
    tokens.series = keys
        .iter()
        .enumerate()
        .map(|(i, k)| line(i, k, &|s| s.tokens_per_s))
        .collect();
    out.plot(&format!("e2e-{}-tokens", m.name), tokens)?;

    let mut roof = chart("fraction of the roofline", "roofline ms / step ms", Scale::Linear);
    roof.series = keys
        .iter()
        .enumerate()
        .map(|(i, k)| line(i, k, &|s| s.roofline_fraction))
        .collect();
    roof.hlines.push(HLine {
        label: format!("target {ROOFLINE_TARGET}"),
        y: ROOFLINE_TARGET,
        color: REFERENCE,
    });
    roof.y_include = vec![0.0, 1.0];
    out.plot(&format!("e2e-{}-roofline", m.name), roof)?;

    table(out, m);
    Ok(())
}

/// The model's steps as a table, then its serving and concurrency measures when present.
fn table(out: &mut Out, m: &E2eModel) {
    let rows = m.steps.iter().map(|s| {
        let kept = if s.form == "spec" {
            format!("{} of {}", s.kept, s.window)
        } else {
            "—".into()
        };
        vec![
            s.form.clone(),
            s.batch.to_string(),
            kept,
            cell(s.step_ms, 3),
            cell(s.tokens_per_s, 3),
            cell(s.roofline_fraction, 2),
        ]
    });
    if !m.steps.is_empty() {
        let head = ["form", "batch", "kept", "step ms", "tokens/s", "roofline fraction"];
        out.table(&head, rows.collect());
    }
    if let Some(s) = &m.serving {
        let int = |v: Option<u64>| v.map_or_else(|| "—".into(), |v| v.to_string());
        out.md.push(String::new());
        out.md.push(format!(
            "Serving at concurrency {}: {} output tokens/s, TTFT p50 {} ms, ITL p50 {} ms.",
            int(s.concurrency),
            cell(s.output_tok_per_s, 3),
            cell(s.ttft_ms_p50, 3),
            cell(s.itl_ms_p50, 3)
        ));
    }
    if let Some(c) = &m.concurrency {
        let admitted = |a: &Option<super::inputs::Admitted>| {
            a.as_ref()
                .and_then(|a| a.admitted)
                .map_or_else(|| "—".into(), |n| n.to_string())
        };
        out.md.push(String::new());
        out.md.push(format!(
            "Measured concurrency ({} tokens of context, {} GiB): snapshots admit {}, replay {} (× {}).",
            c.context.map_or_else(|| "—".into(), |n| n.to_string()),
            cell(c.budget_gib, 3),
            admitted(&c.snapshot),
            admitted(&c.replay),
            cell(c.ratio, 3)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(form: &str, window: u64, kept: u64) -> E2eStep {
        E2eStep {
            form: form.into(),
            batch: 8,
            window,
            kept,
            step_ms: Some(1.0),
            tokens_per_s: None,
            roofline_ms: None,
            roofline_fraction: None,
        }
    }

    #[test]
    fn bench_plot_e2e_series_pick_plain_forms_then_three_kept_counts() {
        let mut steps = vec![
            step("spec", 4, 0),
            step("kv-only", 0, 0),
            step("replay", 0, 0),
            step("recurrent", 0, 0),
        ];
        steps.extend((1..=4).map(|k| step("spec", 4, k)));
        let labels: Vec<String> = keys(&steps).iter().map(Key::label).collect();
        assert_eq!(
            labels,
            [
                "recurrent",
                "replay",
                "kv-only",
                "spec T=4 kept 0",
                "spec T=4 kept 3",
                "spec T=4 kept 4"
            ]
        );
        // T = 1: kept 0 and 1, no duplicate.
        let labels: Vec<String> = keys(&[step("spec", 1, 0), step("spec", 1, 1)])
            .iter()
            .map(Key::label)
            .collect();
        assert_eq!(labels, ["spec T=1 kept 0", "spec T=1 kept 1"]);
    }
}
