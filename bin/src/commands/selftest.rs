//! `rewind selftest --device cuda`: every CUDA op against its CPU twin, then an NCCL all-reduce across the visible
//! GPUs when there are at least two. Prints a table, optionally writes a JSON report, and fails (non-zero exit) when
//! any check fails or the device cannot be used.

use anyhow::{bail, Result};

use crate::cli::SelftestArgs;

/// The ordinal of `cuda` / `cuda:N`; `cpu` and anything else are refused with a reason.
fn parse_device(device: &str) -> Result<usize> {
    match device {
        "cuda" => Ok(0),
        "cpu" => bail!(
            "selftest compares the CUDA ops with their CPU twins; with --device cpu there is nothing to compare \
             (use --device cuda, or `cargo test` for the CPU ops)"
        ),
        d => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(n),
            _ => bail!("unknown device `{d}`: expected `cuda` or `cuda:N`"),
        },
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a Unix time (UTC), without a date crate.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn iso_utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (H. Hinnant), for days since 1970-01-01.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(not(feature = "cuda"))]
pub fn run(args: SelftestArgs) -> Result<()> {
    parse_device(&args.device)?;
    bail!("this rewind was built without the `cuda` feature")
}

#[cfg(feature = "cuda")]
pub fn run(args: SelftestArgs) -> Result<()> {
    // Before any NCCL initialisation and before worker threads read the environment.
    rewind_engine::gpu::device::disable_nvls_unless_set();
    let ordinal = parse_device(&args.device)?;
    cuda::run(args, ordinal)
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::time::{SystemTime, UNIX_EPOCH};

    use anyhow::{bail, Context, Result};
    use rewind_engine::gpu::device::{all_reduce_check, device_count, nvrtc, run_all, Blas, CaseResult, CudaDevice};
    use rewind_engine::shard::nccl::{communicator_check, CommCheckReport};
    use serde_json::{json, Value};

    use super::iso_utc;
    use crate::cli::SelftestArgs;

    /// Elements per GPU in the all-reduce check (an odd count, 64 MiB of f32).
    const NCCL_ELEMENTS: usize = (1 << 24) + 7;
    /// The all-reduce sums at most a handful of f32 values per element in some order.
    const NCCL_THRESHOLD: f64 = 1e-6;
    /// Elements per rank in the communicator check (odd; host slices are staged through the device).
    const COMM_ELEMENTS: usize = (1 << 20) + 3;

    fn fmt_err(e: f64) -> String {
        if e.is_nan() {
            "NaN".into()
        } else if e == 0.0 {
            "0".into()
        } else {
            format!("{e:.2e}")
        }
    }

    fn print_table(results: &[CaseResult]) {
        println!(
            "{:<16} {:<9} {:<70} {:<7} {:>9} {:>7}  result",
            "op", "dtype", "shape", "output", "rel err", "thresh"
        );
        for r in results {
            if let Some(e) = &r.error {
                println!(
                    "{:<16} {:<9} {:<70} {:<7} {:>9} {:>7}  FAIL: {e}",
                    r.op, r.dtype, r.shape, "-", "-", "-"
                );
                continue;
            }
            for c in &r.checks {
                let threshold = format!("{:.0e}", c.threshold);
                println!(
                    "{:<16} {:<9} {:<70} {:<7} {:>9} {:>7}  {}",
                    r.op,
                    r.dtype,
                    r.shape,
                    c.output,
                    fmt_err(c.rel_err),
                    threshold,
                    if c.passed() { "pass" } else { "FAIL" }
                );
            }
        }
    }

    fn case_json(r: &CaseResult) -> Value {
        json!({
            "op": r.op,
            "dtype": r.dtype,
            "shape": r.shape,
            "passed": r.passed(),
            "error": r.error,
            "seconds": r.seconds,
            "checks": r.checks.iter().map(|c| json!({
                "output": c.output,
                "rel_err": if c.rel_err.is_finite() { json!(c.rel_err) } else { json!(fmt_err(c.rel_err)) },
                "threshold": c.threshold,
                "passed": c.passed(),
            })).collect::<Vec<_>>(),
        })
    }

    fn nccl_section(skip: bool) -> (Value, bool) {
        if skip {
            println!("\nNCCL all-reduce: skipped (--no-nccl)");
            return (json!({ "status": "skipped", "reason": "--no-nccl" }), true);
        }
        let gpus = match device_count() {
            Ok(n) => n,
            Err(e) => return (json!({ "status": "error", "error": e.to_string() }), false),
        };
        if gpus < 2 {
            println!("\nNCCL all-reduce: skipped ({gpus} GPU visible; it needs at least 2)");
            return (
                json!({ "status": "skipped", "reason": format!("{gpus} GPU visible"), "gpus": gpus }),
                true,
            );
        }
        let (mut v, ok) = match all_reduce_check(NCCL_ELEMENTS, 0x5eed) {
            Ok(r) => {
                let ok = r.rel_err.is_finite() && r.rel_err <= NCCL_THRESHOLD;
                let gbs = (r.elements * 4) as f64 / r.seconds / 1e9;
                println!(
                    "\nNCCL all-reduce (sum, f32): {} GPUs × {} elements: rel err {} (threshold {NCCL_THRESHOLD:.0e}) {} \
                     [{:.2} ms, {gbs:.1} GB/s algorithm bandwidth, NCCL_NVLS_ENABLE={}]",
                    r.gpus,
                    r.elements,
                    fmt_err(r.rel_err),
                    if ok { "pass" } else { "FAIL" },
                    r.seconds * 1e3,
                    std::env::var("NCCL_NVLS_ENABLE").unwrap_or_default()
                );
                let v = json!({
                    "status": if ok { "pass" } else { "fail" },
                    "gpus": r.gpus,
                    "elements": r.elements,
                    "rel_err": if r.rel_err.is_finite() { json!(r.rel_err) } else { json!(fmt_err(r.rel_err)) },
                    "threshold": NCCL_THRESHOLD,
                    "seconds": r.seconds,
                    "nccl_nvls_enable": std::env::var("NCCL_NVLS_ENABLE").ok(),
                });
                (v, ok)
            }
            Err(e) => {
                println!("\nNCCL all-reduce: FAIL: {e}");
                (json!({ "status": "error", "error": e.to_string() }), false)
            }
        };
        let (comm, comm_ok) = communicator_section(gpus);
        v["communicator"] = comm;
        (v, ok && comm_ok)
    }

    /// The engine's `NcclCommunicator`: one rank thread per GPU, collectives through the `Communicator` trait and on
    /// device buffers (an f32 sub-view, bf16), against host sums.
    fn communicator_section(gpus: usize) -> (Value, bool) {
        match communicator_check(gpus, COMM_ELEMENTS) {
            Ok(r) => {
                let ok = r.passed();
                println!(
                    "NCCL communicator (rank threads): {} GPUs × {} elements: all_reduce_sum rel err {}, all_gather {} \
                     mismatches, sub-view f32 rel err {} (padding {}), bf16 rel err {} (threshold {:.0e}), ranks {} {} \
                     [{:.2} s with set-up]",
                    r.gpus,
                    r.elements,
                    fmt_err(r.all_reduce_rel_err),
                    r.all_gather_mismatches,
                    fmt_err(r.subview_rel_err),
                    if r.subview_padding_intact { "intact" } else { "CHANGED" },
                    fmt_err(r.bf16_rel_err),
                    CommCheckReport::BF16_THRESHOLD,
                    if r.ranks_agree { "agree" } else { "DISAGREE" },
                    if ok { "pass" } else { "FAIL" },
                    r.seconds
                );
                let num = |e: f64| if e.is_finite() { json!(e) } else { json!(fmt_err(e)) };
                let v = json!({
                    "status": if ok { "pass" } else { "fail" },
                    "gpus": r.gpus,
                    "elements": r.elements,
                    "all_reduce_rel_err": num(r.all_reduce_rel_err),
                    "all_gather_mismatches": r.all_gather_mismatches,
                    "subview_rel_err": num(r.subview_rel_err),
                    "subview_padding_intact": r.subview_padding_intact,
                    "bf16_rel_err": num(r.bf16_rel_err),
                    "ranks_agree": r.ranks_agree,
                    "f32_threshold": CommCheckReport::F32_THRESHOLD,
                    "bf16_threshold": CommCheckReport::BF16_THRESHOLD,
                    "seconds": r.seconds,
                });
                (v, ok)
            }
            Err(e) => {
                println!("NCCL communicator (rank threads): FAIL: {e}");
                (json!({ "status": "error", "error": e.to_string() }), false)
            }
        }
    }

    pub(super) fn run(args: SelftestArgs, ordinal: usize) -> Result<()> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let seed = args.seed.unwrap_or(now.as_nanos() as u64);
        let dev = CudaDevice::open(ordinal)?;
        let blas = Blas::new(&dev)?;
        let (major, minor) = dev.arch();
        let (nv_major, nv_minor) = nvrtc::version()?;
        let (_, total_mem) = dev.memory()?;
        println!(
            "device {ordinal}: {} (compute capability {major}.{minor}, {:.1} GiB) | NVRTC {nv_major}.{nv_minor} | seed {seed}",
            dev.name(),
            total_mem as f64 / (1u64 << 30) as f64
        );
        let cache = nvrtc::cache_dir().map_or_else(|| "none".to_string(), |p| p.display().to_string());
        let modules: Vec<Value> = dev
            .modules()
            .iter()
            .map(|m| json!({ "name": m.name, "arch": m.arch, "cached": m.cached, "seconds": m.seconds }))
            .collect();
        let compiled: f64 = dev.modules().iter().map(|m| m.seconds).sum();
        let hits = dev.modules().iter().filter(|m| m.cached).count();
        println!(
            "kernels: {} modules for {} in {compiled:.2} s ({hits} from the cache at {cache})\n",
            dev.modules().len(),
            dev.modules().first().map_or("-", |m| m.arch.as_str())
        );

        let results = run_all(&dev, &blas, seed, args.only.as_deref());
        print_table(&results);
        let (nccl, nccl_ok) = nccl_section(args.no_nccl);
        let (model, model_ok) = if args.no_model {
            println!("\nmodel-level: skipped (--no-model)");
            (json!({ "status": "skipped", "reason": "--no-model" }), true)
        } else {
            super::super::selftest_model::section(
                args.fixtures.as_deref(),
                args.trained_models.as_deref(),
                seed,
                ordinal,
                device_count().unwrap_or(1),
                args.model_tp.as_deref(),
            )
        };

        let checks: usize = results.iter().map(|r| r.checks.len().max(1)).sum();
        let failed_cases: Vec<&CaseResult> = results.iter().filter(|r| !r.passed()).collect();
        let failed_checks: usize = failed_cases
            .iter()
            .map(|r| {
                if r.error.is_some() {
                    1
                } else {
                    r.checks.iter().filter(|c| !c.passed()).count()
                }
            })
            .sum();
        let worst_f32 = results
            .iter()
            .filter(|r| r.dtype == "f32")
            .flat_map(|r| r.checks.iter().map(|c| c.rel_err))
            .fold(0.0f64, rewind_engine::gpu::device::worse);
        println!(
            "\n{} cases, {checks} checks: {} failed{}; worst f32-storage rel err {}",
            results.len(),
            failed_checks,
            if nccl_ok { "" } else { " (and NCCL failed)" },
            fmt_err(worst_f32)
        );

        if let Some(path) = &args.json {
            let report = json!({
                "command": std::env::args().collect::<Vec<_>>().join(" "),
                "date": iso_utc(now.as_secs()),
                "seed": seed,
                "device": {
                    "ordinal": ordinal,
                    "name": dev.name(),
                    "compute_capability": format!("{major}.{minor}"),
                    "memory_bytes": total_mem,
                },
                "nvrtc": { "version": format!("{nv_major}.{nv_minor}"), "cache_dir": cache, "modules": modules },
                "cases": results.iter().map(case_json).collect::<Vec<_>>(),
                "nccl": nccl,
                "model": model,
                "summary": {
                    "cases": results.len(),
                    "checks": checks,
                    "failed_checks": failed_checks,
                    "worst_f32_rel_err": worst_f32,
                    "passed": failed_checks == 0 && nccl_ok && model_ok,
                },
            });
            let text = serde_json::to_string_pretty(&report)?;
            std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        }
        if results.is_empty() {
            bail!("selftest: no case matches --only {:?}", args.only.unwrap_or_default());
        }
        if failed_checks > 0 || !nccl_ok || !model_ok {
            bail!(
                "selftest: {failed_checks} of {checks} checks failed{}{}",
                if nccl_ok { "" } else { ", NCCL checks failed" },
                if model_ok { "" } else { ", the model-level check failed" }
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices() {
        assert_eq!(parse_device("cuda").unwrap(), 0);
        assert_eq!(parse_device("cuda:3").unwrap(), 3);
        assert!(parse_device("cpu")
            .unwrap_err()
            .to_string()
            .contains("nothing to compare"));
        assert!(parse_device("cuda:x").is_err() && parse_device("gpu").is_err());
    }

    #[test]
    fn dates() {
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso_utc(1_795_000_000), "2026-11-18T11:06:40Z");
    }
}
