//! `rewind bench plot`: PNG charts and a markdown index (`plots.md`) drawn from benchmark JSON files.
//!
//! Each input's kind is read from its contents ([`inputs`]): `rewind bench e2e --json` gives per model the decode step
//! time, tokens/s and roofline fraction against batch ([`e2e`]); `rewind bench kernels --json` gives per layer family
//! the achieved bandwidth against batch, with the rows of `bench/peers/ssm_decode.py --json` beside them when that
//! file is given too ([`kernels`]). A series or chart without data is skipped with a note in `plots.md`, never an
//! error: benchmark results often lack a measure (a null roofline, a peer that failed to build).

mod axis;
mod draw;
mod e2e;
#[cfg(test)]
mod fixtures;
mod font;
mod inputs;
mod kernels;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::cli::BenchPlotArgs;
use draw::Chart;
use inputs::{Header, InputData, KernelRow};

/// Runs `rewind bench plot`: reads every input, draws the charts into `--out-dir` and writes `plots.md` there.
pub fn run(args: BenchPlotArgs) -> Result<()> {
    let font = font::load(args.font.as_deref())?;
    let inputs = args.input.iter().map(|p| inputs::read(p)).collect::<Result<Vec<_>>>()?;
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("cannot create the output directory {}", args.out_dir.display()))?;
    let mut out = Out::new(&args.out_dir);
    out.md.push("# Benchmark plots".into());
    out.md.push(String::new());
    out.md
        .push(format!("Drawn by `rewind bench plot` (font {}).", font.display()));

    // Peer rows are drawn beside every kernels input; on their own only when there is none.
    let peers: Vec<&KernelRow> = inputs
        .iter()
        .filter_map(|i| match &i.data {
            InputData::Peers(p) => Some(p.rows.iter()),
            _ => None,
        })
        .flatten()
        .collect();
    let any_kernels = inputs.iter().any(|i| matches!(i.data, InputData::Kernels(_)));
    for input in &inputs {
        out.md.push(String::new());
        let (kind, header) = match &input.data {
            InputData::E2e(r) => ("rewind bench e2e", &r.header),
            InputData::Kernels(r) => ("rewind bench kernels", &r.header),
            InputData::Peers(r) => ("bench/peers/ssm_decode.py", &r.header),
        };
        out.md.push(format!("## {} ({kind})", input.path.display()));
        out.md.push(String::new());
        out.md.push(subtitle(header, None));
        match &input.data {
            InputData::E2e(r) => e2e::section(&mut out, r)?,
            InputData::Kernels(r) => kernels::section(&mut out, r, &peers)?,
            InputData::Peers(r) => kernels::peers_section(&mut out, r, !any_kernels)?,
        }
    }
    let index = args.out_dir.join("plots.md");
    std::fs::write(&index, out.md.join("\n") + "\n").with_context(|| format!("cannot write {}", index.display()))?;
    println!("wrote {} plots and {}", out.written.len(), index.display());
    Ok(())
}

/// The output directory, the markdown being written and the files drawn so far.
pub(crate) struct Out {
    dir: PathBuf,
    used: HashSet<String>,
    /// `plots.md`, line by line.
    pub md: Vec<String>,
    /// The PNGs written.
    pub written: Vec<PathBuf>,
}

impl Out {
    fn new(dir: &Path) -> Self {
        Out {
            dir: dir.to_path_buf(),
            used: HashSet::new(),
            md: Vec::new(),
            written: Vec::new(),
        }
    }

    /// A file name `<stem>.png` not used yet in this run (two inputs with the same model get `-2`, `-3`, …).
    fn file_name(&mut self, stem: &str) -> String {
        let stem = slug(stem);
        let mut name = format!("{stem}.png");
        let mut n = 2;
        while !self.used.insert(name.clone()) {
            name = format!("{stem}-{n}.png");
            n += 1;
        }
        name
    }

    /// Draws `chart` as `<stem>.png` and links it from the markdown, with a note for what had no data.
    pub fn plot(&mut self, stem: &str, mut chart: Chart) -> Result<()> {
        let name = self.file_name(stem);
        let pruned = chart.prune();
        self.md.push(String::new());
        if chart.is_empty() {
            self.md
                .push(format!("_{name} not drawn: no data for {}._", chart.title));
            return Ok(());
        }
        let path = self.dir.join(&name);
        chart.render(&path)?;
        self.written.push(path);
        self.md.push(format!("![{}]({name})", chart.title));
        if !pruned.empty.is_empty() {
            self.md.push(String::new());
            self.md
                .push(format!("_{name}: no data for {}; not drawn._", pruned.empty.join(", ")));
        }
        if pruned.dropped > 0 {
            self.md.push(String::new());
            self.md.push(format!(
                "_{name}: {} point(s) left out (missing, not finite, or not positive on a log axis)._",
                pruned.dropped
            ));
        }
        Ok(())
    }

    /// Appends a markdown table.
    pub fn table(&mut self, head: &[&str], rows: Vec<Vec<String>>) {
        self.md.push(String::new());
        self.md.push(format!("| {} |", head.join(" | ")));
        self.md
            .push(format!("|{}", head.iter().map(|_| "---|").collect::<String>()));
        for r in rows {
            self.md.push(format!("| {} |", r.join(" | ")));
        }
    }
}

/// A chart's second title line: device, what else is known (`extra`), date and commit.
pub(crate) fn subtitle(h: &Header, extra: Option<&str>) -> String {
    let mut parts = vec![h.device.clone().unwrap_or_else(|| "unknown device".into())];
    parts.extend(extra.map(str::to_string));
    parts.extend(h.torch.as_ref().map(|t| format!("torch {t}")));
    // The ISO date's day is enough to tell runs apart in a title.
    parts.extend(h.date.as_ref().map(|d| d.split('T').next().unwrap_or(d).to_string()));
    parts.extend(h.commit.as_ref().map(|c| format!("commit {c}")));
    parts.join(" · ")
}

/// A table cell for an optional number (`—` when absent).
pub(crate) fn cell(v: Option<f64>, sig: i32) -> String {
    v.filter(|v| v.is_finite())
        .map_or_else(|| "—".into(), |v| draw::num(v, sig))
}

/// `s` made safe as a file name: ASCII letters, digits, `.`, `_` and `-`; anything else becomes `-`.
fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
