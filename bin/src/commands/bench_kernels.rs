//! `rewind bench kernels --device cuda`: the SSM decode kernels of one layer at real shapes, timed on the GPU by
//! `rewind_kernels::cuda::bench_decode` (recurrent, replay and its flush step, verify, the serial snapshot baseline,
//! batch 1 … 512). Prints the markdown tables and writes them, and the JSON rows, where asked. The JSON rows share
//! their schema with `bench/peers/ssm_decode.py`'s, so peer and rewind rows join on (family, kernel, batch, window).

use anyhow::{bail, Result};
use rewind_kernels::cuda::bench_decode::{Family, Report, Row, Sweep};
use serde_json::{json, Value};

use crate::cli::{BenchKernelsArgs, KernelFamily};

/// The ordinal of `cuda` / `cuda:N`; `cpu` and anything else are refused with a reason.
fn ordinal(device: &str) -> Result<usize> {
    match device {
        "cuda" => Ok(0),
        "cpu" => bail!(
            "bench kernels times the CUDA decode kernels; --device cpu has none (use --device cuda or cuda:N; the CPU \
             path is timed end to end by plain `rewind bench`)"
        ),
        d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(n),
            _ => bail!("unknown device `{d}`: expected `cuda` or `cuda:N`"),
        },
    }
}

/// The sweep the flags ask for (the defaults are the issue's: every family, batch 1 … 512).
fn sweep(args: &BenchKernelsArgs) -> Result<Sweep> {
    let mut s = Sweep {
        families: match args.family {
            KernelFamily::Mamba2 => vec![Family::Mamba2],
            KernelFamily::Gdn => vec![Family::Gdn],
            KernelFamily::All => Family::ALL.to_vec(),
        },
        repeats: args.repeats,
        ..Sweep::default()
    };
    if let Some(b) = &args.batch {
        s.batches = b.clone();
    }
    s.validate().map_err(|e| {
        anyhow::anyhow!(
            "{}",
            e.replace("batch sizes", "--batch sizes")
                .replace("repeats", "--repeats")
        )
    })?;
    Ok(s)
}

/// One row as JSON: the schema `bench/peers/ssm_decode.py` writes too (`impl` tells them apart).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn row_json(r: &Row) -> Value {
    json!({
        "impl": "rewind",
        "family": r.family.name(),
        "kernel": r.kernel.kind(),
        "label": r.kernel.label(),
        "batch": r.batch,
        "ring_len": r.kernel.l(),
        "window": r.kernel.t(),
        "accepted": r.accepted,
        "ms": r.ms,
        "ms_min": r.ms_min,
        "ms_max": r.ms_max,
        "bytes": r.bytes,
        "gb_s": r.gbs,
        "frac_copy": r.frac_copy,
        "vs_recurrent": r.vs_recurrent,
        "commit": r.commit,
    })
}

/// The whole report as JSON, after the `header` fields (command, date, commit).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn report_json(report: &Report, header: Value) -> Value {
    let mut v = header;
    let s = &report.sweep;
    let more = json!({
        "device": report.device,
        "arch": format!("sm_{}{}", report.arch.0, report.arch.1),
        "sm_count": report.sm_count,
        "copy_gb_s": report.copy_gbs,
        "read_gb_s": report.read_gbs,
        "dtypes": "bf16 inputs, rings and outputs; fp32 state",
        "shapes": s.families.iter().map(|f| json!({"family": f.name(), "shape": f.shape()})).collect::<Vec<_>>(),
        "sweep": {
            "batches": s.batches,
            "ring_lens": s.ring_lens,
            "windows": s.windows,
            "verify_ring": s.verify_ring,
            "warmup": s.warmup,
            "repeats": s.repeats,
        },
        "rows": report.rows.iter().map(row_json).collect::<Vec<_>>(),
    });
    for (k, x) in more.as_object().into_iter().flatten() {
        v[k] = x.clone();
    }
    v
}

/// What every result records: the command line, the date and the commit this binary was built from.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn header() -> Value {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "date_unix": secs,
        "date": super::selftest::iso_utc(secs),
        "commit": super::bench::git_commit(),
    })
}

/// The markdown header lines of `header()`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn header_lines(h: &Value) -> Vec<(&'static str, String)> {
    ["date", "commit", "command"]
        .into_iter()
        .map(|k| (k, h[k].as_str().unwrap_or("unknown").to_string()))
        .collect()
}

#[cfg(not(feature = "cuda"))]
pub fn run(args: BenchKernelsArgs) -> Result<()> {
    ordinal(&args.device)?;
    sweep(&args)?;
    Err(super::no_cuda())
}

#[cfg(feature = "cuda")]
pub fn run(args: BenchKernelsArgs) -> Result<()> {
    use anyhow::Context;
    use rewind_kernels::cuda::bench_decode::{render, run_sweep};
    use rewind_kernels::cuda::CudaDevice;

    use crate::output::{errln, outln};

    let ordinal = ordinal(&args.device)?;
    let sweep = sweep(&args)?;
    let dev = CudaDevice::open(ordinal)?;
    errln!(
        "{} (GPU {ordinal}): {} cases, {} warm-up and {} timed launches each",
        dev.name(),
        sweep.cases().len(),
        sweep.warmup,
        sweep.repeats
    );
    let report = run_sweep(&dev, &sweep, |r| errln!("{}", render::line(r)))?;
    let h = header();
    let md = render::markdown(&report, &header_lines(&h));
    outln!("{md}")?;
    if let Some(path) = &args.markdown {
        std::fs::write(path, &md).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.json {
        let v = report_json(&report, h);
        std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rewind_kernels::cuda::bench_decode::Kernel;

    fn args(family: KernelFamily, batch: Option<Vec<usize>>, repeats: usize) -> BenchKernelsArgs {
        BenchKernelsArgs {
            device: "cuda".into(),
            family,
            batch,
            repeats,
            json: None,
            markdown: None,
        }
    }

    #[test]
    fn flags_make_the_sweep() {
        let s = sweep(&args(KernelFamily::All, None, 20)).expect("default sweep");
        assert_eq!(s, Sweep::default());
        let s = sweep(&args(KernelFamily::Gdn, Some(vec![64, 256]), 50)).expect("sweep");
        assert_eq!(
            (s.families, s.batches, s.repeats),
            (vec![Family::Gdn], vec![64, 256], 50)
        );
        let e = sweep(&args(KernelFamily::All, Some(vec![0]), 20)).expect_err("batch 0");
        assert!(e.to_string().contains("--batch sizes"), "{e}");
        let e = sweep(&args(KernelFamily::All, None, 0)).expect_err("no repeats");
        assert!(e.to_string().contains("--repeats"), "{e}");
    }

    #[test]
    fn devices_other_than_cuda_are_refused() {
        assert_eq!(ordinal("cuda").ok(), Some(0));
        assert_eq!(ordinal("cuda:3").ok(), Some(3));
        assert!(ordinal("cpu")
            .expect_err("cpu")
            .to_string()
            .contains("--device cpu has none"));
        assert!(ordinal("tpu").expect_err("tpu").to_string().contains("unknown device"));
    }

    #[test]
    fn json_rows_carry_the_shared_schema() {
        let r = Row::new(
            Family::Mamba2,
            Kernel::Verify { l: 16, t: 4 },
            64,
            &[1.0, 2.0, 4.0],
            3e9,
            3000.0,
        );
        let v = row_json(&r);
        assert_eq!(v["impl"], "rewind");
        assert_eq!(v["family"], "mamba2");
        assert_eq!(v["kernel"], "verify");
        assert_eq!(
            (v["batch"].as_u64(), v["ring_len"].as_u64(), v["window"].as_u64()),
            (Some(64), Some(16), Some(4))
        );
        assert!(v["accepted"].is_null());
        assert_eq!(
            (v["ms"].as_f64(), v["ms_min"].as_f64(), v["ms_max"].as_f64()),
            (Some(2.0), Some(1.0), Some(4.0))
        );
        assert_eq!((v["gb_s"].as_f64(), v["frac_copy"].as_f64()), (Some(1500.0), Some(0.5)));
        assert!(v["commit"].as_str().is_some_and(|c| c.contains("no device work")));
        let step = row_json(&Row::new(Family::Gdn, Kernel::RecurrentStep, 1, &[0.01], 1e6, 3000.0));
        assert!(step["ring_len"].is_null() && step["commit"].is_null());
        assert_eq!(step["window"], 1);
    }

    #[test]
    fn report_json_has_the_header_and_the_device() {
        let sweep = Sweep {
            families: vec![Family::Gdn],
            batches: vec![8],
            ..Sweep::default()
        };
        let report = Report {
            device: "Test GPU".into(),
            arch: (9, 0),
            sm_count: 132,
            copy_gbs: 3000.0,
            read_gbs: 3300.0,
            rows: vec![Row::new(Family::Gdn, Kernel::Replay { l: 16 }, 8, &[0.1], 1e8, 3000.0)],
            sweep,
        };
        let v = report_json(&report, json!({"commit": "abc1234", "date": "2026-11-26T10:00:00Z"}));
        assert_eq!(
            (v["commit"].as_str(), v["device"].as_str()),
            (Some("abc1234"), Some("Test GPU"))
        );
        assert_eq!(
            (v["arch"].as_str(), v["copy_gb_s"].as_f64()),
            (Some("sm_90"), Some(3000.0))
        );
        assert_eq!(v["sweep"]["batches"], json!([8]));
        assert_eq!(v["shapes"][0]["family"], "gdn");
        assert_eq!(v["rows"].as_array().map(Vec::len), Some(1));
        let lines = header_lines(&v);
        assert_eq!(lines[1], ("commit", "abc1234".to_string()));
        assert_eq!(lines[2], ("command", "unknown".to_string()));
    }
}
