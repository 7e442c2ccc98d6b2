//! The embedded default model: the `small` Nemotron-H preset, built deterministically on first use and cached.

use std::path::PathBuf;

use anyhow::{Context, Result};
use rewind_engine::init::{init_model, InitOptions};
use rewind_engine::model::Family;

/// Bumped whenever the preset or the initialiser changes, so a stale cache is never reused.
const DEFAULT_MODEL_VERSION: u32 = 1;

fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("REWIND_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("rewind");
    }
    match std::env::var_os("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("rewind"),
        None => std::env::temp_dir().join("rewind-cache"),
    }
}

/// The default model's directory, building it if it is not cached yet.
pub fn default_model_dir() -> Result<PathBuf> {
    let dir = cache_root().join(format!("default-nemotron_h-small-v{DEFAULT_MODEL_VERSION}"));
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    eprintln!(
        "building the default model (nemotron_h `small` preset, seed 0) in {} ...",
        dir.display()
    );
    let parent = dir.parent().context("cache directory has no parent")?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    // Build beside the final place and rename, so an interrupted build never leaves a half-written cache.
    let tmp = parent.join(format!(".building-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    init_model(&InitOptions {
        family: Family::NemotronH,
        preset: "small".into(),
        layers: None,
        seed: 0,
        out: tmp.clone(),
        dtype: None,
        mtp: false,
    })?;
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        // Another process may have finished first; use its copy if so.
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join("config.json").is_file() {
            return Err(e).with_context(|| format!("moving the default model into {}", dir.display()));
        }
    }
    Ok(dir)
}
