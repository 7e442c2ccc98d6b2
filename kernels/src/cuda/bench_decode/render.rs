//! Markdown of a decode-kernel [`Report`]: one table per family (kernel forms down, batch sizes across, each cell the
//! median time and the fraction of copy bandwidth the byte model's bytes reach), then the targets.

use std::fmt::Write;

use super::{Family, Kernel, Report, Row, REPLAY_COMMIT};

/// Roofline fraction a replay decode step should reach, by batch.
const REPLAY_ROOFLINE: [(usize, f64); 2] = [(64, 0.90), (256, 0.95)];

/// Batch at which replay's speed-up over the recurrent step is judged.
const SPEEDUP_BATCH: usize = 256;

/// Speed-up of replay over the recurrent step a family should reach at [`SPEEDUP_BATCH`].
fn speedup_target(f: Family) -> f64 {
    match f {
        Family::Mamba2 => 1.8,
        Family::Gdn => 1.7,
    }
}

/// Verify window whose time is judged against one standard step, and the most it may take.
const VERIFY_T: usize = 4;
const VERIFY_MAX: f64 = 1.3;

/// The whole report: `header` lines (date, commit, command: whatever the caller records) first.
pub fn markdown(report: &Report, header: &[(&str, String)]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# SSM decode kernels, one layer ({})\n", report.device);
    for (k, v) in header {
        let _ = writeln!(s, "- {k}: {v}");
    }
    let _ = writeln!(
        s,
        "- device: {}, sm_{}{}, {} SMs; copy bandwidth {:.0} GB/s (1 GiB device-to-device, read + write, this run); \
         read-only bandwidth {:.0} GB/s (1 GiB read once, 16-byte loads: what a step that only reads its state can \
         approach)",
        report.device, report.arch.0, report.arch.1, report.sm_count, report.copy_gbs, report.read_gbs
    );
    let _ = writeln!(
        s,
        "- bf16 inputs, rings and outputs, fp32 state; CUDA events, {} warm-up launches then the median of {}; state \
         slots and token rows rotated between launches beyond L2",
        report.sweep.warmup, report.sweep.repeats
    );
    let _ = writeln!(
        s,
        "- cells: median ms · fraction of copy bandwidth the byte model's bytes reach (state, ring, inputs, outputs)"
    );
    let _ = writeln!(s, "- verify rows: {REPLAY_COMMIT}\n");
    for &f in &report.sweep.families {
        family_table(&mut s, report, f);
        spec_table(&mut s, report, f);
    }
    targets(&mut s, report);
    s
}

fn family_table(s: &mut String, report: &Report, f: Family) {
    let batches = &report.sweep.batches;
    let _ = writeln!(s, "## {}\n", f.shape());
    header_row(s, "kernel", batches);
    for k in report.sweep.kernels() {
        let _ = write!(s, "| {} |", k.label());
        for &b in batches {
            let _ = write!(s, " {} |", cell(report.find(f, k, b)));
        }
        s.push('\n');
    }
    s.push('\n');
}

/// A speculative step's SSM work, replay against the serial baseline: the baseline's verify plus its commit of `a`
/// drafts over replay's verify (whose commit moves no data), for none and for all of the window accepted.
fn spec_table(s: &mut String, report: &Report, f: Family) {
    let sweep = &report.sweep;
    if sweep.windows.is_empty() {
        return;
    }
    let batches = &sweep.batches;
    let _ = writeln!(
        s,
        "Baseline (verify + commit) over replay verify (L={}), {}:\n",
        sweep.verify_ring,
        f.name()
    );
    header_row(s, "window, accepted", batches);
    for &t in &sweep.windows {
        for a in [0, t] {
            let _ = write!(s, "| T={t}, {a} accepted |");
            for &b in batches {
                let ratio = spec_ratio(report, f, t, a, b);
                let _ = write!(s, " {} |", ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}×")));
            }
            s.push('\n');
        }
    }
    s.push('\n');
}

/// The baseline's verify of `t` drafts plus its commit of `a` over replay's verify of `t`, at `batch`.
fn spec_ratio(report: &Report, f: Family, t: usize, a: usize, batch: usize) -> Option<f64> {
    let l = report.sweep.verify_ring;
    let replay = report.find(f, Kernel::Verify { l, t }, batch)?.ms;
    let verify = report.find(f, Kernel::BaselineVerify { t }, batch)?.ms;
    let commit = report.find(f, Kernel::BaselineCommit { accepted: a }, batch)?.ms;
    Some((verify + commit) / replay)
}

/// A table's head: `first`, then one column per batch size.
fn header_row(s: &mut String, first: &str, batches: &[usize]) {
    let _ = write!(s, "| {first} |");
    for b in batches {
        let _ = write!(s, " batch {b} |");
    }
    let _ = write!(s, "\n|---|");
    for _ in batches {
        let _ = write!(s, "---|");
    }
    s.push('\n');
}

/// `0.429 ms · 0.87`, or `-` for a case not measured.
pub fn cell(row: Option<&Row>) -> String {
    match row {
        Some(r) => format!("{:.3} ms · {:.2}", r.ms, r.frac_copy),
        None => "-".into(),
    }
}

/// One row on one line, for progress output: `mamba2 replay L=16  batch 256:  0.429 ms  1838 MB  4284 GB/s  0.87 of copy`.
pub fn line(r: &Row) -> String {
    format!(
        "{:<6} {:<34} batch {:>4}: {:>8.3} ms  {:>8.1} MB  {:>5.0} GB/s  {:.2} of copy",
        r.family.name(),
        r.kernel.label(),
        r.batch,
        r.ms,
        r.bytes / 1e6,
        r.gbs,
        r.frac_copy
    )
}

/// A replay step averaged over a ring's cycle: `L − 1` plain steps at fills `0 ..= L − 2` and one flush step.
fn amortised_replay_ms(report: &Report, f: Family, l: usize, batch: usize) -> Option<f64> {
    let plain = report.find(f, Kernel::Replay { l }, batch)?.ms;
    let flush = report.find(f, Kernel::ReplayFlush { l }, batch)?.ms;
    Some(((l - 1) as f64 * plain + flush) / l as f64)
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "yes"
    } else {
        "**no**"
    }
}

fn targets(s: &mut String, report: &Report) {
    let _ = writeln!(s, "## Targets\n");
    let _ = writeln!(s, "| family | target | batch | measured | met |\n|---|---|---|---|---|");
    let sweep = &report.sweep;
    for &f in &sweep.families {
        for &l in &sweep.ring_lens {
            for (b, want) in REPLAY_ROOFLINE {
                if let Some(r) = report.find(f, Kernel::Replay { l }, b) {
                    let _ = writeln!(
                        s,
                        "| {} | replay L={l} ≥ {want:.2} of its byte roofline | {b} | {:.2} | {} |",
                        f.name(),
                        r.frac_copy,
                        verdict(r.frac_copy >= want)
                    );
                }
            }
            let b = SPEEDUP_BATCH;
            let (Some(rec), Some(rep)) = (
                report.find(f, Kernel::RecurrentStep, b),
                report.find(f, Kernel::Replay { l }, b),
            ) else {
                continue;
            };
            let want = speedup_target(f);
            let plain = rec.ms / rep.ms;
            let cycle = amortised_replay_ms(report, f, l, b).map(|ms| rec.ms / ms);
            let _ = writeln!(
                s,
                "| {} | replay L={l} ≥ {want}× recurrent step | {b} | {plain:.2}× ({} with the flush step every {l}) | {} |",
                f.name(),
                cycle.map_or_else(|| "-".into(), |c| format!("{c:.2}×")),
                verdict(cycle.unwrap_or(plain) >= want)
            );
        }
        let l = sweep.verify_ring;
        if !sweep.windows.contains(&VERIFY_T) {
            continue;
        }
        for &b in &sweep.batches {
            let Some(v) = report.find(f, Kernel::Verify { l, t: VERIFY_T }, b) else {
                continue;
            };
            // The standard step of the same form: replay decode at the verify's ring, else the recurrent step.
            let (name, step) = match report.find(f, Kernel::Replay { l }, b) {
                Some(r) => (format!("replay L={l} step"), r),
                None => match report.find(f, Kernel::RecurrentStep, b) {
                    Some(r) => ("recurrent step".to_string(), r),
                    None => continue,
                },
            };
            let ratio = v.ms / step.ms;
            let _ = writeln!(
                s,
                "| {} | verify T={VERIFY_T} ≤ {VERIFY_MAX}× one {name}, every accepted count (commit: no device work) | \
                 {b} | {ratio:.2}× | {} |",
                f.name(),
                verdict(ratio <= VERIFY_MAX)
            );
        }
    }
    s.push('\n');
}
