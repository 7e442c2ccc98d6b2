//! `rewind compile-kernels`: every kernel module (`rewind_kernels::cuda::nvrtc::MODULES`) compiled by NVRTC for each
//! requested real architecture, without a driver or a GPU, the way a device compiles them when it opens. It fails
//! (non-zero exit) when a module does not compile for a target or lacks an entry point it declares (and, with
//! `--deny-spills`, when an entry point spills), and prints per module and target the entry points, the most
//! registers a thread and any spills. CI runs the same check for Hopper and Blackwell (`kernels/tests/nvrtc_compile.rs`).

use anyhow::{bail, Result};

use crate::cli::CompileKernelsArgs;

/// The architecture number of a real target (`sm_90` → 90, `sm_100a` → 100), or why it is not one.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn arch_number(target: &str) -> Result<i32> {
    let digits = target
        .strip_prefix("sm_")
        .map(|d| d.trim_end_matches(['a', 'f']))
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()));
    match digits.and_then(|d| d.parse().ok()) {
        Some(n) => Ok(n),
        None => bail!("`{target}` is not a real GPU architecture: expected sm_XY (e.g. sm_90, sm_100, sm_100a)"),
    }
}

/// Each requested target's architecture number, checked before NVRTC is asked anything; with `--fill-cache` only the
/// plain `sm_XY` a device asks for (an `sm_90a` image would sit in the cache unread).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn target_numbers(arch: &[String], fill_cache: bool) -> Result<Vec<i32>> {
    if arch.is_empty() {
        bail!("--arch names no target");
    }
    arch.iter()
        .map(|target| {
            let n = arch_number(target)?;
            if fill_cache && target != &format!("sm_{n}") {
                bail!("--fill-cache: a device asks for sm_{n}, never `{target}`, so its image would never be read");
            }
            Ok(n)
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: CompileKernelsArgs) -> Result<()> {
    bail!("this rewind was built without the `cuda` feature: it has no CUDA kernels to compile")
}

#[cfg(feature = "cuda")]
pub fn run(args: CompileKernelsArgs) -> Result<()> {
    cuda::run(args)
}

#[cfg(feature = "cuda")]
mod cuda {
    use anyhow::{bail, Context, Result};
    use rewind_kernels::cuda::kernel_check::{check_modules, ModuleCheck};
    use rewind_kernels::cuda::nvrtc::{self, KernelModule};
    use serde_json::json;

    use super::target_numbers;
    use crate::cli::CompileKernelsArgs;
    use crate::output::errln;

    /// One module for one target: its check, or the compiler's error.
    struct Outcome {
        module: &'static str,
        target: String,
        result: Result<ModuleCheck, String>,
    }

    pub fn run(args: CompileKernelsArgs) -> Result<()> {
        let numbers = target_numbers(&args.arch, args.fill_cache)?;
        let (major, minor) = nvrtc::version().context("NVRTC is needed to compile the kernels")?;
        let supported = nvrtc::supported_archs()?;
        for (target, &n) in args.arch.iter().zip(&numbers) {
            if !supported.contains(&n) {
                bail!("NVRTC {major}.{minor} cannot build for {target}; it supports sm_{supported:?}");
            }
        }
        let modules: Vec<&KernelModule> = nvrtc::MODULES
            .iter()
            .filter(|m| args.only.as_ref().is_none_or(|o| m.name.contains(o.as_str())))
            .collect();
        if modules.is_empty() {
            bail!(
                "no kernel module's name contains `{}`",
                args.only.as_deref().unwrap_or("")
            );
        }
        errln!(
            "NVRTC {major}.{minor}: {} modules for {}",
            modules.len(),
            args.arch.join(", ")
        );
        let targets: Vec<&str> = args.arch.iter().map(String::as_str).collect();
        let outcomes: Vec<Outcome> = check_modules(&modules, &targets)
            .into_iter()
            .map(|(module, target, result)| Outcome {
                module,
                target,
                result: result.map_err(|e| e.to_string()),
            })
            .collect();
        let (mut failed, mut missing, mut spilling) = (0, 0, 0);
        for o in &outcomes {
            match &o.result {
                Ok(c) => {
                    let regs = c.entries.iter().map(|e| e.registers).max().unwrap_or(0);
                    let spills: Vec<String> = c
                        .entries
                        .iter()
                        .filter(|e| e.spills())
                        .map(|e| format!("{} ({} B stores, {} B loads)", e.name, e.spill_stores, e.spill_loads))
                        .collect();
                    missing += c.missing.len();
                    spilling += spills.len();
                    let status = if c.missing.is_empty() { "ok" } else { "MISSING" };
                    println!(
                        "{status:7} {:18} {:8} {:3} entry points, ≤ {regs:3} registers, {:5.1} s{}{}",
                        o.module,
                        o.target,
                        c.entries.len(),
                        c.seconds,
                        if c.missing.is_empty() {
                            String::new()
                        } else {
                            format!("; missing: {}", c.missing.join(", "))
                        },
                        if spills.is_empty() {
                            String::new()
                        } else {
                            format!("; spills: {}", spills.join(", "))
                        },
                    );
                }
                Err(e) => {
                    failed += 1;
                    println!("FAILED  {:18} {:8} {e}", o.module, o.target);
                }
            }
        }
        if let Some(path) = &args.json {
            let report = json!({
                "nvrtc": format!("{major}.{minor}"),
                "targets": args.arch,
                "modules": outcomes.iter().map(outcome_json).collect::<Vec<_>>(),
            });
            std::fs::write(path, serde_json::to_string_pretty(&report)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        println!(
            "{} compiles: {} failed, {missing} entry points missing, {spilling} entry points spill",
            outcomes.len(),
            failed
        );
        if failed > 0 || missing > 0 {
            bail!("{failed} module compiles failed and {missing} declared entry points are missing");
        }
        if args.deny_spills && spilling > 0 {
            bail!("{spilling} entry points spill registers (--deny-spills)");
        }
        if args.fill_cache {
            fill_cache(&modules, &targets)?;
        }
        Ok(())
    }

    /// Stores every module's image for every target in the kernel cache (`--fill-cache`).
    fn fill_cache(modules: &[&KernelModule], targets: &[&str]) -> Result<()> {
        use rayon::prelude::*;
        let jobs: Vec<(&KernelModule, &str)> = targets
            .iter()
            .flat_map(|&t| modules.iter().map(move |&m| (m, t)))
            .collect();
        let paths = jobs
            .into_par_iter()
            .map(|(m, t)| nvrtc::fill_cache(m, t).with_context(|| format!("caching {} for {t}", m.name)))
            .collect::<Result<Vec<_>>>()?;
        let bytes: u64 = paths
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum();
        let dir = paths.first().and_then(|p| p.parent());
        println!(
            "cached {} images ({:.1} MB) in {}",
            paths.len(),
            bytes as f64 / 1e6,
            dir.map_or_else(|| "-".into(), |d| d.display().to_string())
        );
        Ok(())
    }

    fn outcome_json(o: &Outcome) -> serde_json::Value {
        match &o.result {
            Ok(c) => json!({
                "module": o.module,
                "target": o.target,
                "ok": c.missing.is_empty(),
                "seconds": c.seconds,
                "missing": c.missing,
                "entries": c.entries.iter().map(|e| json!({
                    "name": e.name,
                    "registers": e.registers,
                    "stack_bytes": e.stack_bytes,
                    "spill_stores": e.spill_stores,
                    "spill_loads": e.spill_loads,
                })).collect::<Vec<_>>(),
            }),
            Err(e) => json!({"module": o.module, "target": o.target, "ok": false, "error": e}),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_architectures_parse_and_others_are_refused() {
        assert_eq!(arch_number("sm_90").unwrap(), 90);
        assert_eq!(arch_number("sm_100a").unwrap(), 100);
        assert_eq!(arch_number("sm_103f").unwrap(), 103);
        for bad in ["compute_90", "sm_", "sm_9x", "90", "sm_a"] {
            let e = arch_number(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("sm_XY"), "{e}");
        }
    }

    #[test]
    fn the_cache_is_filled_only_for_the_targets_a_device_asks_for() {
        let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            target_numbers(&list(&["sm_90", "sm_100a"]), false).unwrap(),
            vec![90, 100]
        );
        assert_eq!(
            target_numbers(&list(&["sm_90", "sm_103"]), true).unwrap(),
            vec![90, 103]
        );
        let e = target_numbers(&list(&["sm_90", "sm_100a"]), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sm_100a") && e.contains("--fill-cache"), "{e}");
        assert!(target_numbers(&[], false)
            .unwrap_err()
            .to_string()
            .contains("no target"));
    }
}
