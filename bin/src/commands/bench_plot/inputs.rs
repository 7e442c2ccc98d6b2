//! The benchmark JSON files `rewind bench plot` reads, parsed into typed structs.
//!
//! Three kinds, told apart by their contents: `rewind bench e2e --json` (top-level `"kind": "rewind-bench-e2e"`),
//! `rewind bench kernels --json` (`rows` and `copy_gb_s`, every row's `impl` is `rewind`) and
//! `bench/peers/ssm_decode.py --json` (the kernels schema plus `torch`, rows naming the peer in `impl`).
//! Every measured number is optional: JSON has no NaN (serde_json writes a non-finite f64 as `null`) and one missing
//! value must cost one point of a plot, not the whole run.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

/// The `kind` of `rewind bench e2e --json`.
pub const E2E_KIND: &str = "rewind-bench-e2e";

/// One input file and what it holds.
#[derive(Debug)]
pub struct Input {
    /// The file as given on the command line.
    pub path: PathBuf,
    /// Its parsed contents.
    pub data: InputData,
}

/// The contents of one input, by kind.
#[derive(Debug)]
pub enum InputData {
    /// `rewind bench e2e --json`.
    E2e(E2eReport),
    /// `rewind bench kernels --json`.
    Kernels(KernelsReport),
    /// `bench/peers/ssm_decode.py --json` (the kernels schema, rows of other implementations).
    Peers(KernelsReport),
}

/// The header fields every result may carry (absent ones are `None`).
#[derive(Debug, Default, Deserialize)]
pub struct Header {
    /// The GPU's name.
    #[serde(default)]
    pub device: Option<String>,
    /// ISO date of the run.
    #[serde(default)]
    pub date: Option<String>,
    /// The git commit the binary was built from.
    #[serde(default)]
    pub commit: Option<String>,
    /// Device-to-device copy bandwidth of the same run, GB/s.
    #[serde(default)]
    pub copy_gb_s: Option<f64>,
    /// The torch version (peer files only).
    #[serde(default)]
    pub torch: Option<String>,
}

/// `rewind bench e2e --json`.
#[derive(Debug, Deserialize)]
pub struct E2eReport {
    /// Device, date, commit, copy bandwidth.
    #[serde(flatten)]
    pub header: Header,
    /// Activation / weight dtype.
    #[serde(default)]
    pub dtype: Option<String>,
    /// One entry per swept model.
    pub models: Vec<E2eModel>,
}

/// One model of an e2e sweep.
#[derive(Debug, Deserialize)]
pub struct E2eModel {
    /// Preset or directory name.
    pub name: String,
    /// One-line shape summary.
    #[serde(default)]
    pub summary: Option<String>,
    /// The batched decode steps measured.
    #[serde(default)]
    pub steps: Vec<E2eStep>,
    /// Serving through the coordinator, when measured.
    #[serde(default)]
    pub serving: Option<Serving>,
    /// Measured concurrency (snapshots vs replay), when measured.
    #[serde(default)]
    pub concurrency: Option<Concurrency>,
}

/// One batched decode step measure.
#[derive(Debug, Deserialize)]
pub struct E2eStep {
    /// `recurrent`, `replay`, `kv-only` or `spec`.
    pub form: String,
    /// Sequences per step.
    pub batch: u64,
    /// Drafts per verify (spec), else 0.
    #[serde(default)]
    pub window: u64,
    /// Drafts kept after the verify (spec), else 0.
    #[serde(default)]
    pub kept: u64,
    /// Median milliseconds per step.
    #[serde(default)]
    pub step_ms: Option<f64>,
    /// Tokens per second over the batch.
    #[serde(default)]
    pub tokens_per_s: Option<f64>,
    /// What the byte model says the step would take at copy bandwidth, ms.
    #[serde(default)]
    pub roofline_ms: Option<f64>,
    /// `roofline_ms / step_ms`.
    #[serde(default)]
    pub roofline_fraction: Option<f64>,
}

/// `rewind bench --concurrency` through the coordinator.
#[derive(Debug, Deserialize)]
pub struct Serving {
    /// Requests kept in flight.
    #[serde(default)]
    pub concurrency: Option<u64>,
    /// Output tokens per second.
    #[serde(default)]
    pub output_tok_per_s: Option<f64>,
    /// Median time to first token, ms.
    #[serde(default)]
    pub ttft_ms_p50: Option<f64>,
    /// Median inter-token latency, ms.
    #[serde(default)]
    pub itl_ms_p50: Option<f64>,
}

/// Sequences admitted under one memory budget: per-draft snapshots vs replay.
#[derive(Debug, Deserialize)]
pub struct Concurrency {
    /// Context of every admitted sequence, tokens.
    #[serde(default)]
    pub context: Option<u64>,
    /// Memory budget beyond the weights, GiB.
    #[serde(default)]
    pub budget_gib: Option<f64>,
    /// The snapshot baseline's admissions.
    #[serde(default)]
    pub snapshot: Option<Admitted>,
    /// Replay's admissions.
    #[serde(default)]
    pub replay: Option<Admitted>,
    /// Replay over snapshot admissions.
    #[serde(default)]
    pub ratio: Option<f64>,
}

/// How many sequences one form admitted.
#[derive(Debug, Deserialize)]
pub struct Admitted {
    /// Sequences admitted.
    #[serde(default)]
    pub admitted: Option<u64>,
}

/// `rewind bench kernels --json` or `bench/peers/ssm_decode.py --json`.
#[derive(Debug, Deserialize)]
pub struct KernelsReport {
    /// Device, date, commit, copy bandwidth, torch.
    #[serde(flatten)]
    pub header: Header,
    /// One row per (family, kernel, batch).
    pub rows: Vec<KernelRow>,
}

/// One kernel measure (`row_json` in bin/src/commands/bench_kernels.rs, `row` in bench/peers/ssm_decode.py).
#[derive(Debug, Deserialize)]
pub struct KernelRow {
    /// `rewind`, or the peer's name.
    #[serde(default, rename = "impl")]
    pub implementation: Option<String>,
    /// `mamba2` or `gdn`.
    pub family: String,
    /// Kernel kind: `recurrent_step`, `replay`, `verify`, `baseline_verify`, … (peers: `recurrent_window`).
    pub kernel: String,
    /// Table label (`replay L=16`); peers have none.
    #[serde(default)]
    pub label: Option<String>,
    /// Rows per launch.
    pub batch: u64,
    /// Ring capacity L, for kernels with a ring.
    #[serde(default)]
    pub ring_len: Option<u64>,
    /// Tokens each row appends (verify window T, else 1).
    #[serde(default)]
    pub window: Option<u64>,
    /// Accepted drafts, for the rows whose time depends on it.
    #[serde(default)]
    pub accepted: Option<u64>,
    /// Median milliseconds per launch.
    #[serde(default)]
    pub ms: Option<f64>,
    /// Achieved bandwidth, GB/s.
    #[serde(default)]
    pub gb_s: Option<f64>,
    /// `gb_s` over the copy bandwidth.
    #[serde(default)]
    pub frac_copy: Option<f64>,
}

impl KernelRow {
    /// The row's name in tables and legends: its label, else the kernel with its window, ring and accepted count.
    pub fn name(&self) -> String {
        if let Some(l) = &self.label {
            return l.clone();
        }
        let mut s = self.kernel.clone();
        if let Some(t) = self.window.filter(|&t| t > 1) {
            s += &format!(" T={t}");
        }
        if let Some(l) = self.ring_len {
            s += &format!(" L={l}");
        }
        if let Some(a) = self.accepted {
            s += &format!(", {a} accepted");
        }
        s
    }
}

/// Reads and parses one input, telling its kind from its contents.
pub fn read(path: &Path) -> Result<Input> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let data = parse(&text, path)?;
    Ok(Input {
        path: path.to_path_buf(),
        data,
    })
}

/// Parses the text of `path` (named in every error).
pub fn parse(text: &str, path: &Path) -> Result<InputData> {
    let file = path.display();
    let v: Value = serde_json::from_str(text).with_context(|| format!("{file}: not valid JSON"))?;
    let Some(obj) = v.as_object() else {
        bail!("{file}: the top level is not a JSON object, so it is no benchmark result");
    };
    match obj.get("kind") {
        Some(Value::String(k)) if k == E2E_KIND => return typed(v, path, "rewind bench e2e").map(InputData::E2e),
        Some(k) => bail!(
            "{file}: unknown benchmark kind {k}: `rewind bench plot` reads \"{E2E_KIND}\" (rewind bench e2e --json), \
             `rewind bench kernels --json` and bench/peers/ssm_decode.py --json"
        ),
        None => {}
    }
    let Some(rows) = obj.get("rows").and_then(Value::as_array) else {
        bail!(
            "{file}: not a benchmark result `rewind bench plot` knows: no \"kind\": \"{E2E_KIND}\" \
             (rewind bench e2e --json) and no \"rows\" array (rewind bench kernels --json, \
             bench/peers/ssm_decode.py --json)"
        );
    };
    // Both kernels schemas share their rows; the peer script adds `torch` at the top and names the peer in `impl`.
    let peer_row = |r: &Value| r.get("impl").and_then(Value::as_str).is_some_and(|i| i != "rewind");
    if obj.contains_key("torch") || rows.iter().any(peer_row) {
        typed(v, path, "bench/peers/ssm_decode.py").map(InputData::Peers)
    } else {
        typed(v, path, "rewind bench kernels").map(InputData::Kernels)
    }
}

/// Deserializes `v`, naming the file and the field (`models[0].steps[3].batch`) on error.
fn typed<T: DeserializeOwned>(v: Value, path: &Path, what: &str) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let at = e.path().to_string();
        let at = if at == "." {
            "the top level".to_string()
        } else {
            format!("field `{at}`")
        };
        anyhow!("{}: {what} JSON: {at}: {}", path.display(), e.inner())
    })
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{e2e_json, kernels_json, peers_json};
    use super::*;
    use serde_json::json;

    fn parse_value(v: &Value) -> Result<InputData> {
        parse(&v.to_string(), Path::new("/tmp/x.json"))
    }

    #[test]
    fn bench_plot_parses_the_three_kinds() {
        let Ok(InputData::E2e(e)) = parse_value(&e2e_json()) else {
            panic!("e2e not parsed")
        };
        assert_eq!((e.models.len(), e.models[0].steps.len()), (1, 32));
        assert_eq!(e.header.commit.as_deref(), Some("abc1234"));
        assert_eq!(e.models[0].steps[2].roofline_ms, None);
        let Ok(InputData::Kernels(k)) = parse_value(&kernels_json()) else {
            panic!("kernels not parsed")
        };
        assert_eq!((k.rows.len(), k.header.copy_gb_s), (40, Some(3000.0)));
        assert_eq!(
            (k.rows[0].name(), k.rows[3].name()),
            ("recurrent (step kernel)".into(), "verify T=4 L=16".into())
        );
        let Ok(InputData::Peers(p)) = parse_value(&peers_json()) else {
            panic!("peers not parsed")
        };
        assert_eq!(p.header.torch.as_deref(), Some("2.9.0"));
        assert_eq!(
            p.rows[0].implementation.as_deref(),
            Some("mamba_ssm selective_state_update")
        );
    }

    #[test]
    fn bench_plot_null_measures_parse() {
        let mut v = kernels_json();
        v["rows"][1]["ms"] = Value::Null;
        v["rows"][1]["gb_s"] = Value::Null;
        let Ok(InputData::Kernels(k)) = parse_value(&v) else {
            panic!("kernels with nulls not parsed")
        };
        assert_eq!(k.rows[1].gb_s, None);
    }

    #[test]
    fn bench_plot_errors_name_the_file_and_field() {
        let err = |v: Value| parse_value(&v).err().map(|e| format!("{e:#}")).unwrap_or_default();
        let unknown = err(json!({"kind": "something-else"}));
        assert!(
            unknown.contains("/tmp/x.json") && unknown.contains("unknown benchmark kind"),
            "{unknown}"
        );
        let none = err(json!({"device": "x"}));
        assert!(none.contains("/tmp/x.json") && none.contains("no \"rows\""), "{none}");
        let mut v = e2e_json();
        v["models"][0]["steps"][3]["batch"] = json!("eight");
        let bad = err(v);
        assert!(
            bad.contains("/tmp/x.json") && bad.contains("models[0].steps[3].batch"),
            "{bad}"
        );
        let mut v = kernels_json();
        v["rows"][2].as_object_mut().map(|r| r.remove("family"));
        let missing = err(v);
        assert!(missing.contains("rows[2]") && missing.contains("family"), "{missing}");
        let not_json = parse("{", Path::new("/tmp/y.json"))
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(not_json.contains("/tmp/y.json: not valid JSON"), "{not_json}");
    }

    #[test]
    fn bench_plot_read_names_a_missing_file() {
        let e = read(Path::new("/nonexistent/bench.json"))
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(e.contains("cannot read /nonexistent/bench.json"), "{e}");
    }
}
