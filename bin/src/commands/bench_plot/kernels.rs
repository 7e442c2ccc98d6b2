//! The charts and tables of `rewind bench kernels --json` (per family, achieved bandwidth against batch) and of
//! `bench/peers/ssm_decode.py --json` (the same schema, other implementations).

use anyhow::Result;

use super::draw::{color, Chart, HLine, Scale, Series, REFERENCE};
use super::inputs::{KernelRow, KernelsReport};
use super::{cell, subtitle, Out};

/// The ring capacity and verify window drawn when present (the engine's defaults); the tables hold every row.
const PREFERRED_RING: u64 = 16;
const PREFERRED_WINDOW: u64 = 4;

/// The families of `rows`, in order of appearance.
fn families<'a>(rows: impl Iterator<Item = &'a KernelRow>) -> Vec<&'a str> {
    let mut f: Vec<&str> = Vec::new();
    for r in rows {
        if !f.contains(&r.family.as_str()) {
            f.push(&r.family);
        }
    }
    f
}

/// One line of a chart: its label and its rows.
type Line<'a> = (String, Vec<&'a KernelRow>);

/// What tells peer lines apart: implementation, kernel, window.
type PeerKey = (String, String, u64);

/// `preferred` if `values` holds it, else the first of them.
fn pick(mut values: Vec<u64>, preferred: u64) -> Option<u64> {
    values.sort_unstable();
    values
        .contains(&preferred)
        .then_some(preferred)
        .or(values.first().copied())
}

/// A row's window, 1 where absent (the recurrent kernels append one token).
fn window(r: &KernelRow) -> u64 {
    r.window.unwrap_or(1)
}

/// The rewind lines of one family's chart: recurrent, replay at one ring, verify and the snapshot baseline at one
/// window. Every ring and window would be a dozen lines; the table has them all.
fn rewind_lines<'a>(rows: &[&'a KernelRow]) -> Vec<Line<'a>> {
    let of = |kernel: &str| rows.iter().copied().filter(|r| r.kernel == kernel).collect::<Vec<_>>();
    let mut lines = Vec::new();
    let recurrent = of("recurrent_step");
    if let Some(first) = recurrent.first() {
        lines.push((first.name(), recurrent.clone()));
    }
    let replay = of("replay");
    if let Some(l) = pick(replay.iter().filter_map(|r| r.ring_len).collect(), PREFERRED_RING) {
        lines.push((
            format!("replay L={l}"),
            replay.into_iter().filter(|r| r.ring_len == Some(l)).collect(),
        ));
    }
    let verify = of("verify");
    let t = pick(verify.iter().map(|r| window(r)).collect(), PREFERRED_WINDOW);
    if let Some(t) = t {
        let v: Vec<&KernelRow> = verify.into_iter().filter(|r| window(r) == t).collect();
        let l = v
            .iter()
            .find_map(|r| r.ring_len)
            .map_or_else(String::new, |l| format!(" (L={l})"));
        lines.push((format!("verify T={t}{l}"), v));
    }
    let baseline = of("baseline_verify");
    let bt = t.filter(|t| baseline.iter().any(|r| window(r) == *t));
    if let Some(bt) = bt.or_else(|| pick(baseline.iter().map(|r| window(r)).collect(), PREFERRED_WINDOW)) {
        let b: Vec<&KernelRow> = baseline.into_iter().filter(|r| window(r) == bt).collect();
        lines.push((format!("baseline verify T={bt} (snapshots)"), b));
    }
    lines
}

/// The peer lines of one family: one per (implementation, kernel, window), windows 1 and `t` only.
fn peer_lines<'a>(rows: &[&'a KernelRow], t: u64) -> Vec<Line<'a>> {
    let mut groups: Vec<(PeerKey, Vec<&KernelRow>)> = Vec::new();
    for r in rows.iter().copied().filter(|r| window(r) == 1 || window(r) == t) {
        let key = (
            r.implementation.clone().unwrap_or_else(|| "peer".into()),
            r.kernel.clone(),
            window(r),
        );
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    let names: Vec<&String> = groups.iter().map(|((i, _, _), _)| i).collect();
    let ambiguous = |i: &String| names.iter().filter(|n| **n == i).count() > 1;
    groups
        .iter()
        .map(|((i, k, w), g)| {
            let label = if ambiguous(i) {
                format!("{i} ({k} T={w})")
            } else {
                i.clone()
            };
            (label, g.clone())
        })
        .collect()
}

/// The bandwidth chart of one family: `lines` solid, the copy bandwidth as a reference.
fn chart(title: String, sub: String, lines: Vec<Line<'_>>, copy: Option<f64>) -> Chart {
    let series = lines
        .into_iter()
        .enumerate()
        .map(|(i, (label, rows))| Series {
            label,
            color: color(i),
            dashed: false,
            points: rows.iter().filter_map(|r| Some((r.batch as f64, r.gb_s?))).collect(),
        })
        .collect();
    Chart {
        title,
        subtitle: sub,
        x_desc: "batch (rows per launch, log2)".into(),
        y_desc: "achieved GB/s (log)".into(),
        x_scale: Scale::Log2,
        y_scale: Scale::Log10,
        series,
        hlines: copy
            .map(|c| HLine {
                label: format!("copy {} GB/s", super::draw::num(c, 4)),
                y: c,
                color: REFERENCE,
            })
            .into_iter()
            .collect(),
        y_include: Vec::new(),
    }
}

/// Writes the section of a kernels result: per family the bandwidth chart (with `peers`' rows of the family) and
/// the table of every row.
pub fn section(out: &mut Out, r: &KernelsReport, peers: &[&KernelRow]) -> Result<()> {
    if r.rows.is_empty() {
        out.md.push(String::new());
        out.md.push("_No row in this result._".into());
    }
    for family in families(r.rows.iter()) {
        out.md.push(String::new());
        out.md.push(format!("### {family}"));
        let rows: Vec<&KernelRow> = r.rows.iter().filter(|x| x.family == family).collect();
        let fam_peers: Vec<&KernelRow> = peers.iter().copied().filter(|x| x.family == family).collect();
        let mut lines = rewind_lines(&rows);
        let t = rows
            .iter()
            .filter(|x| x.kernel == "verify")
            .map(|x| window(x))
            .collect();
        lines.extend(peer_lines(
            &fam_peers,
            pick(t, PREFERRED_WINDOW).unwrap_or(PREFERRED_WINDOW),
        ));
        let title = format!("{family} decode kernels: achieved bandwidth");
        let c = chart(title, subtitle(&r.header, None), lines, r.header.copy_gb_s);
        out.plot(&format!("kernels-{family}-bandwidth"), c)?;

        let head = [
            "kernel",
            "batch",
            "ms",
            "GB/s",
            "frac of copy",
            "vs peer (peer ms ÷ ms)",
        ];
        let table = rows.iter().map(|x| {
            let vs: Vec<String> = fam_peers
                .iter()
                .filter(|p| p.kernel == x.kernel && p.batch == x.batch && window(p) == window(x))
                .filter_map(|p| {
                    let ratio = p.ms? / x.ms.filter(|&m| m > 0.0)?;
                    let name = p.implementation.as_deref().unwrap_or("peer");
                    Some(format!("{} ({name})", super::draw::num(ratio, 3)))
                })
                .collect();
            let vs = if vs.is_empty() {
                "—".to_string()
            } else {
                vs.join("; ")
            };
            vec![
                x.name(),
                x.batch.to_string(),
                cell(x.ms, 3),
                cell(x.gb_s, 4),
                cell(x.frac_copy, 2),
                vs,
            ]
        });
        out.table(&head, table.collect());
    }
    Ok(())
}

/// Writes the section of a peers result: per family its table, and its chart when `draw` (no kernels input to draw
/// its rows beside).
pub fn peers_section(out: &mut Out, r: &KernelsReport, draw: bool) -> Result<()> {
    if r.rows.is_empty() {
        out.md.push(String::new());
        out.md.push("_No row in this result (see its `errors`)._".into());
    }
    for family in families(r.rows.iter()) {
        out.md.push(String::new());
        out.md.push(format!("### {family} (peers)"));
        let rows: Vec<&KernelRow> = r.rows.iter().filter(|x| x.family == family).collect();
        if draw {
            let lines = peer_lines(&rows, PREFERRED_WINDOW);
            let title = format!("{family} decode step, peers: achieved bandwidth");
            let c = chart(title, subtitle(&r.header, None), lines, r.header.copy_gb_s);
            out.plot(&format!("peers-{family}-bandwidth"), c)?;
        } else {
            out.md.push(String::new());
            out.md.push("Drawn beside the kernels above.".into());
        }
        let head = ["implementation", "kernel", "T", "batch", "ms", "GB/s", "frac of copy"];
        let table = rows.iter().map(|x| {
            vec![
                x.implementation.clone().unwrap_or_else(|| "—".into()),
                x.kernel.clone(),
                window(x).to_string(),
                x.batch.to_string(),
                cell(x.ms, 3),
                cell(x.gb_s, 4),
                cell(x.frac_copy, 2),
            ]
        });
        out.table(&head, table.collect());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::bench_plot::fixtures::{kernels_json, peers_json};
    use crate::commands::bench_plot::inputs::{self, InputData};
    use std::path::Path;

    fn report(v: serde_json::Value) -> KernelsReport {
        match inputs::parse(&v.to_string(), Path::new("k.json")) {
            Ok(InputData::Kernels(r) | InputData::Peers(r)) => r,
            other => panic!("not a kernels result: {other:?}"),
        }
    }

    #[test]
    fn bench_plot_kernels_lines_pick_a_readable_subset() {
        let k = report(kernels_json());
        let rows: Vec<&KernelRow> = k.rows.iter().filter(|r| r.family == "gdn").collect();
        let labels: Vec<String> = rewind_lines(&rows).into_iter().map(|(l, _)| l).collect();
        assert_eq!(
            labels,
            [
                "recurrent_step",
                "replay L=16",
                "verify T=4 (L=16)",
                "baseline verify T=4 (snapshots)"
            ]
        );
        let p = report(peers_json());
        let rows: Vec<&KernelRow> = p.rows.iter().filter(|r| r.family == "mamba2").collect();
        let lines = peer_lines(&rows, 4);
        assert_eq!(
            (lines.len(), lines[0].0.as_str(), lines[0].1.len()),
            (1, "mamba_ssm selective_state_update", 4)
        );
    }
}
