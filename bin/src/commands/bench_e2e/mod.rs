//! `rewind bench e2e`: the end-to-end sweep on random-weight models of real shapes (issue "benchmarks", item 3).
//!
//! Every measure is one run of the model benchmark (`rewind bench`, `commands/bench.rs`) with the flags the sweep
//! picks, so the timing code, warm-up, medians and byte roofline are that benchmark's, not a second copy: per model,
//! one run per decode form (`spec` is the replay run with `--verify-window T`, which times verify steps keeping
//! exactly 0 … T drafts: oracle acceptance), one serving run through the coordinator (`--concurrency`), and on GPUs
//! the concurrency a fixed memory budget admits with per-draft snapshots vs replay (`admit.rs`). The results are
//! gathered into one JSON document (schema `rewind-bench-e2e`, `docs/benchmarks.md`) and markdown tables; `rewind
//! bench plot` draws them.

mod admit;
mod rows;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use rewind_engine::init::{init_model, InitOptions};
use rewind_engine::model::ModelConfig;
use rewind_engine::presets::{parse_arch, PRESETS};
use rewind_engine::words::count;
use serde_json::{json, Value};

use crate::cli::{BenchE2eArgs, Cli, Command, Device};
use crate::output::{errln, outln};

/// The forms the sweep knows, in the order they run.
const FORMS: [&str; 4] = ["recurrent", "replay", "kv-only", "spec"];

/// Seed of the random checkpoints (any fixed value: the same weights every run).
const INIT_SEED: u64 = 7;

/// One model to sweep: where its checkpoint is and what to call it.
struct ModelSpec {
    name: String,
    dir: PathBuf,
}

/// The flags, checked before anything is built or loaded.
struct Sweep {
    gpu: bool,
    forms: Vec<&'static str>,
}

fn check(args: &BenchE2eArgs) -> Result<Sweep> {
    let gpu = Device::parse(&args.device, 1).with_context(|| format!("--device `{}`", args.device))? != Device::Cpu;
    anyhow::ensure!(!args.batch.is_empty(), "--batch needs at least one batch size");
    anyhow::ensure!(args.batch.iter().all(|&b| b > 0), "--batch sizes must be positive");
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    anyhow::ensure!(args.decode_tokens > 0, "--decode-tokens must be at least 1");
    anyhow::ensure!(args.step_prompt > 0, "--step-prompt must be at least 1");
    let mut forms = Vec::new();
    for f in &args.forms {
        match FORMS.iter().find(|&&k| k == f.as_str()) {
            Some(k) if !forms.contains(k) => forms.push(*k),
            Some(_) => bail!("--forms names `{f}` twice"),
            None => bail!("--forms: unknown form `{f}`; expected recurrent, replay, kv-only or spec"),
        }
    }
    anyhow::ensure!(!forms.is_empty(), "--forms needs at least one form");
    forms.sort_by_key(|f| FORMS.iter().position(|k| k == f));
    if forms.contains(&"spec") {
        anyhow::ensure!(args.spec_window > 0, "--spec-window must be at least 1");
    }
    if !args.no_serving {
        anyhow::ensure!(
            args.concurrency > 0,
            "--concurrency must be at least 1 (or pass --no-serving)"
        );
        anyhow::ensure!(
            args.requests > 0,
            "--requests must be at least 1 (or pass --no-serving)"
        );
        anyhow::ensure!(args.serving_prompt > 1, "--serving-prompt must be at least 2");
        anyhow::ensure!(args.serving_tokens > 0, "--serving-tokens must be at least 1");
    }
    if !args.no_concurrency {
        anyhow::ensure!(
            gpu,
            "the measured concurrency loads GPU ranks under a memory budget; pass --no-concurrency with --device cpu"
        );
        anyhow::ensure!(args.admit_context > 0, "--admit-context must be at least 1");
        anyhow::ensure!(
            args.admit_budget_gib.is_finite() && args.admit_budget_gib > 0.0,
            "--admit-budget-gib must be a positive number of GiB, got {}",
            args.admit_budget_gib
        );
        anyhow::ensure!(
            args.spec_window > 0,
            "--spec-window must be at least 1 (the snapshots per sequence)"
        );
    }
    match args.dtype.as_str() {
        "bf16" | "f32" => {}
        other => bail!("--dtype `{other}`: expected bf16 or f32"),
    }
    for l in &args.layers {
        layers_entry(l)?;
    }
    if args.model_dirs.is_empty() {
        anyhow::ensure!(
            !args.models.is_empty(),
            "--models needs at least one preset (or pass --model-dir)"
        );
        for m in &args.models {
            preset(m)?;
        }
    }
    Ok(Sweep { gpu, forms })
}

/// `PRESET=N` of --layers.
fn layers_entry(s: &str) -> Result<(&str, usize)> {
    let (p, n) = s
        .split_once('=')
        .with_context(|| format!("--layers `{s}`: expected PRESET=N, e.g. nemotron-3-nano-30b-a3b=12"))?;
    let n: usize = n
        .parse()
        .ok()
        .filter(|&n| n > 0)
        .with_context(|| format!("--layers `{s}`: the layer count must be a positive integer"))?;
    Ok((p, n))
}

/// A preset by name (`ARCH:PRESET` picks among presets of the same name in several families, e.g. `qwen3_5:tiny`).
fn preset(name: &str) -> Result<(rewind_engine::model::Family, &str)> {
    let (family, bare) = match name.split_once(':') {
        Some((arch, p)) => (Some(parse_arch(arch)?), p),
        None => (None, name),
    };
    let found: Vec<_> = PRESETS
        .iter()
        .filter(|p| p.name == bare && family.is_none_or(|f| f == p.family))
        .collect();
    match found.as_slice() {
        [one] => Ok((one.family, one.name)),
        [] => bail!("--models: unknown preset `{name}` (`rewind init-model --help` lists them)"),
        _ => {
            bail!("--models: preset `{name}` exists in several families; name one as ARCH:PRESET, e.g. qwen3_5:{bare}")
        }
    }
}

/// The models to sweep: the given directories, or the presets written with random weights under `work`.
fn models(args: &BenchE2eArgs, work: &Path) -> Result<Vec<ModelSpec>> {
    if !args.model_dirs.is_empty() {
        return Ok(args
            .model_dirs
            .iter()
            .map(|d| ModelSpec {
                name: d
                    .file_name()
                    .map_or_else(|| d.display().to_string(), |n| n.to_string_lossy().into()),
                dir: d.clone(),
            })
            .collect());
    }
    let mut out = Vec::new();
    for m in &args.models {
        let (family, name) = preset(m)?;
        let layers = args
            .layers
            .iter()
            .filter_map(|l| layers_entry(l).ok())
            .find(|(p, _)| *p == name || *p == m.as_str())
            .map(|(_, n)| n);
        // Named as given: `qwen3_5:tiny` and `nemotron_h:tiny` must not share a directory.
        let dir = work.join(m.replace(':', "-"));
        if !dir.join("config.json").exists() {
            let t0 = std::time::Instant::now();
            init_model(&InitOptions {
                family,
                preset: name.to_string(),
                layers,
                seed: INIT_SEED,
                out: dir.clone(),
                dtype: None,
                mtp: false,
            })
            .with_context(|| format!("writing the random {name} checkpoint"))?;
            errln!("wrote {} in {:.1} s", dir.display(), t0.elapsed().as_secs_f64());
        }
        let label = match layers {
            Some(n) => format!("{m} ({})", count(n as u64, "layer")),
            None => m.clone(),
        };
        out.push(ModelSpec { name: label, dir });
    }
    Ok(out)
}

/// Runs `rewind bench` with `flags` (after `--model dir --device ...`) and returns its JSON.
fn bench(args: &BenchE2eArgs, dir: &Path, flags: &[String], gpu: bool) -> Result<Value> {
    let out = tempfile::NamedTempFile::new().context("a temporary file for a bench run's JSON")?;
    let mut argv: Vec<String> = ["rewind", "bench", "--model"].map(String::from).to_vec();
    argv.push(dir.display().to_string());
    argv.extend(["--device".into(), args.device.clone()]);
    if gpu {
        argv.extend(["--dtype".into(), args.dtype.clone()]);
    }
    argv.extend(flags.iter().cloned());
    argv.extend(["--json".into(), out.path().display().to_string()]);
    errln!("\n$ {}", argv[1..].join(" "));
    let cli = Cli::try_parse_from(&argv).map_err(|e| anyhow::anyhow!("{e}"))?;
    let Command::Bench(b) = cli.command else {
        bail!("internal: the sweep built a command other than bench");
    };
    super::bench::run(b).with_context(|| format!("`{}`", argv[1..].join(" ")))?;
    let text = std::fs::read_to_string(out.path()).context("reading a bench run's JSON")?;
    serde_json::from_str(&text).context("parsing a bench run's JSON")
}

/// The prompt of the prefill measure each run starts with: 1024 tokens, or less where the model's context is short.
fn prefill_len(config: &ModelConfig, args: &BenchE2eArgs) -> usize {
    let room = config
        .max_position_embeddings
        .saturating_sub(args.decode_tokens.max(args.serving_tokens));
    room.clamp(2, 1024)
}

/// One model's sweep; `save` gets the model's results so far after every stage (a sweep cut short by a time limit
/// still leaves what it measured).
fn sweep_model(
    args: &BenchE2eArgs,
    sweep: &Sweep,
    m: &ModelSpec,
    save: &mut dyn FnMut(&Value) -> Result<()>,
) -> Result<Value> {
    let config = ModelConfig::from_dir(&m.dir)?;
    let mut model = json!({
        "name": m.name,
        "summary": config.summary(),
        "dir": m.dir.display().to_string(),
        "device": Value::Null,
        "copy_gb_s": Value::Null,
        "prefill_tok_per_s": {},
        "steps": [],
        "serving": Value::Null,
        "concurrency": Value::Null,
    });
    let batches = args.batch.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(",");
    let common = |form: &str| -> Vec<String> {
        vec![
            "--decode".into(),
            form.into(),
            "--batch".into(),
            batches.clone(),
            "--decode-tokens".into(),
            args.decode_tokens.to_string(),
            "--step-prompt".into(),
            args.step_prompt.to_string(),
            "--repeats".into(),
            args.repeats.to_string(),
            "--prompt-len".into(),
            prefill_len(&config, args).to_string(),
        ]
    };
    let mut steps = Vec::new();
    let mut prefill = serde_json::Map::new();
    let mut copy_gbs = None;
    let mut device = None;
    for form in ["recurrent", "replay", "kv-only"] {
        let spec = form == "replay" && sweep.forms.contains(&"spec");
        if !sweep.forms.contains(&form) && !spec {
            continue;
        }
        let mut flags = common(form);
        if spec {
            flags.extend(["--verify-window".into(), args.spec_window.to_string()]);
        }
        let r = bench(args, &m.dir, &flags, sweep.gpu)?;
        copy_gbs = copy_gbs.or(r["copy_gb_s"].as_f64());
        device = device.or(r["device"].as_str().map(String::from));
        prefill.insert(form.into(), r["prefill_tok_per_s"].clone());
        if sweep.forms.contains(&form) {
            steps.extend(rows::decode_rows(form, &r)?);
        }
        if spec {
            steps.extend(rows::verify_rows(&r)?);
        }
        rows::speedups(&mut steps);
        model["device"] = json!(device);
        model["copy_gb_s"] = json!(copy_gbs);
        model["prefill_tok_per_s"] = json!(prefill);
        model["steps"] = json!(steps);
        save(&model)?;
    }
    let serving = if args.no_serving {
        Value::Null
    } else {
        let mut flags: Vec<String> = [
            "--concurrency",
            &args.concurrency.to_string(),
            "--requests",
            &args.requests.to_string(),
            "--serving-only",
            "--prompt-len",
            &args.serving_prompt.to_string(),
            "--decode-tokens",
            &args.serving_tokens.to_string(),
        ]
        .map(String::from)
        .to_vec();
        // Slots for every request in flight; a GPU-only flag (the CPU sizes its pools from the requests).
        if sweep.gpu {
            flags.extend(["--max-seqs".into(), args.concurrency.to_string()]);
        }
        rows::serving(&bench(args, &m.dir, &flags, sweep.gpu)?["serving"])?
    };
    model["serving"] = serving;
    save(&model)?;
    if !args.no_concurrency {
        model["concurrency"] = admit::measure(args, &m.dir)?;
    }
    Ok(model)
}

pub fn run(args: BenchE2eArgs) -> Result<()> {
    let sweep = check(&args)?;
    #[cfg(not(feature = "cuda"))]
    if sweep.gpu {
        return Err(super::no_cuda());
    }
    // Before any checkpoint is written: a machine without a usable driver fails here, in one line.
    #[cfg(feature = "cuda")]
    if sweep.gpu {
        rewind_engine::gpu::device::device_count().context("the GPU sweep needs CUDA")?;
    }
    let temp;
    let work = match &args.work_dir {
        Some(w) => {
            std::fs::create_dir_all(w).with_context(|| format!("creating --work-dir {}", w.display()))?;
            w.clone()
        }
        None => {
            temp = tempfile::tempdir().context("a temporary directory for the random checkpoints")?;
            temp.path().to_path_buf()
        }
    };
    let specs = models(&args, &work)?;
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut done: Vec<Value> = Vec::new();
    for m in &specs {
        let finished = done.clone();
        let mut save = |current: &Value| {
            let mut all = finished.clone();
            all.push(current.clone());
            write(&args, &sweep, secs, &all, false).map(drop)
        };
        done.push(sweep_model(&args, &sweep, m, &mut save)?);
        write(&args, &sweep, secs, &done, false)?;
    }
    let md = write(&args, &sweep, secs, &done, true)?;
    println!();
    for line in md.lines() {
        outln!("{line}")?;
    }
    Ok(())
}

/// Writes the document of the models so far (`complete` once every model's sweep has ended); returns its markdown.
fn write(args: &BenchE2eArgs, sweep: &Sweep, secs: u64, models: &[Value], complete: bool) -> Result<String> {
    let report = json!({
        "kind": "rewind-bench-e2e",
        "complete": complete,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "date": super::selftest::iso_utc(secs),
        "date_unix": secs,
        "commit": super::bench::git_commit(),
        "device": models.iter().find_map(|m| m["device"].as_str()).unwrap_or(&args.device),
        "copy_gb_s": models.iter().find_map(|m| m["copy_gb_s"].as_f64()),
        "dtype": if sweep.gpu { args.dtype.as_str() } else { "f32" },
        "settings": {
            "batches": args.batch, "forms": sweep.forms, "spec_window": args.spec_window,
            "decode_tokens": args.decode_tokens, "step_prompt": args.step_prompt, "repeats": args.repeats,
        },
        "models": models,
    });
    let md = rows::markdown(&report);
    if let Some(p) = &args.markdown {
        std::fs::write(p, &md).with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(md)
}

#[cfg(test)]
mod tests;
