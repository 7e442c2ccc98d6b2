//! `rewind init-model` refuses what it used to do silently: growing a preset with `--layers`, overwriting a non-empty
//! `--out` without `--force`; `rewind generate` names the file of a bad sampling default; and every id an init-model
//! checkpoint's config allows decodes to text with the tokenizer written beside it.

use std::path::{Path, PathBuf};
use std::process::Output;

use rewind_engine::tokenizer::Tokenizer;

use crate::common;
use common::{rewind, stderr};

/// The command failed with exactly one `error: ...` line on stderr, holding every needle.
fn assert_one_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    // The models here are init-model checkpoints: the note that says so is not an error line.
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("note: this model has RANDOM weights"))
        .collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {err}");
    assert!(lines[0].starts_with("error: "), "not an error line: {err}");
    for n in needles {
        assert!(lines[0].contains(n), "stderr lacks `{n}`: {err}");
    }
}

/// A fresh (absent) directory for the test `tag`; tests run in parallel.
fn fresh_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rewind-init-hardening-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn init(arch: &str, preset: &str, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "init-model",
        "--arch",
        arch,
        "--preset",
        preset,
        "--out",
        out.to_str().expect("utf8"),
    ];
    args.extend_from_slice(extra);
    rewind(&args)
}

fn config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config.json")).expect("json")
}

#[test]
fn layers_beyond_the_preset_depth_are_refused() {
    let out = fresh_dir("layers");
    for (arch, layers, depth) in [
        ("nemotron_h", "999", "6"),
        ("nemotron_h", "7", "6"),
        ("qwen3_5", "5", "4"),
        ("qwen3_next", "999", "4"),
        ("nemotron_h", "0", "6"),
    ] {
        let o = init(arch, "tiny", &out, &["--layers", layers]);
        assert_one_error(&o, &["--layers", layers, &format!("has {depth} layers"), "tiny"]);
        assert!(!out.exists(), "{arch} --layers {layers}: wrote {}", out.display());
    }
    assert_one_error(
        &init("nemotron_h", "nemotron-h-8b", &out, &["--layers", "999"]),
        &["999", "nemotron-h-8b", "has 52 layers"],
    );
    assert!(!out.exists());

    // Cutting depth still works, and the whole depth is allowed.
    for (arch, layers) in [("nemotron_h", "2"), ("nemotron_h", "6"), ("qwen3_5", "4")] {
        let _ = std::fs::remove_dir_all(&out);
        let o = init(arch, "tiny", &out, &["--layers", layers]);
        assert!(o.status.success(), "{arch} --layers {layers}: {}", stderr(&o));
        assert_eq!(config(&out)["num_hidden_layers"].to_string(), layers);
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_non_empty_out_is_refused_unless_forced() {
    let out = fresh_dir("force");
    // An existing empty directory (what `tempfile::tempdir()` gives) is fine.
    std::fs::create_dir_all(&out).expect("mkdir");
    let o = init("nemotron_h", "tiny", &out, &["--seed", "1"]);
    assert!(o.status.success(), "into an empty directory: {}", stderr(&o));
    let weights = out.join("model.safetensors");
    let first = std::fs::read(&weights).expect("weights");

    // A second write is refused and touches nothing.
    let o = init("nemotron_h", "tiny", &out, &["--seed", "2"]);
    assert_one_error(&o, &[out.to_str().expect("utf8"), "not empty", "--force"]);
    assert_eq!(
        std::fs::read(&weights).expect("weights"),
        first,
        "refused write changed the weights"
    );

    // With --force the checkpoint is replaced: new weights, a stale chat template gone, unrelated files kept.
    std::fs::write(out.join("chat_template.jinja"), "stale").expect("write");
    std::fs::write(out.join("notes.txt"), "mine").expect("write");
    let o = init("qwen3_5", "tiny", &out, &["--seed", "2", "--force"]);
    assert!(o.status.success(), "--force: {}", stderr(&o));
    assert_ne!(
        std::fs::read(&weights).expect("weights"),
        first,
        "--force kept the old weights"
    );
    assert_eq!(config(&out)["model_type"], "qwen3_5_text");
    assert!(
        !out.join("chat_template.jinja").exists(),
        "stale chat template left behind"
    );
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).expect("notes"), "mine");
    let o = rewind(&[
        "generate",
        "hi",
        "--model",
        out.to_str().expect("utf8"),
        "--max-tokens",
        "2",
        "--temperature",
        "0",
    ]);
    assert!(
        o.status.success(),
        "the forced checkpoint does not load: {}",
        stderr(&o)
    );

    // A file where the directory should be.
    let file = out.join("notes.txt");
    for extra in [&[][..], &["--force"][..]] {
        assert_one_error(
            &init("nemotron_h", "tiny", &file, extra),
            &["notes.txt", "not a directory"],
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_bad_generation_config_is_named_by_path() {
    let out = fresh_dir("genconfig");
    let o = init("nemotron_h", "tiny", &out, &[]);
    assert!(o.status.success(), "init-model: {}", stderr(&o));
    let path = out.join("generation_config.json");
    let model = out.to_str().expect("utf8");
    for (text, field, value) in [
        (r#"{"eos_token_id": 2, "temperature": -3}"#, "temperature", "-3"),
        (r#"{"eos_token_id": 2, "top_p": 1.5}"#, "top_p", "1.5"),
        (
            r#"{"eos_token_id": 2, "repetition_penalty": 0}"#,
            "repetition_penalty",
            "0",
        ),
        (r#"{"eos_token_id": 2, "temperature": "hot"}"#, "temperature", "hot"),
    ] {
        std::fs::write(&path, text).expect("write");
        let o = rewind(&["generate", "hi", "--model", model, "--max-tokens", "2"]);
        assert_one_error(&o, &[&format!("{}: {field}", path.display()), value]);
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// Every id below the config's `vocab_size` decodes to text as generation shows it (specials skipped, so only the
/// three specials themselves may be empty), with the tokenizer init-model wrote.
fn assert_every_id_decodes(dir: &Path) {
    let vocab_size = config(dir)["vocab_size"].as_u64().expect("vocab_size") as u32;
    let tok = Tokenizer::from_dir(dir).expect("tokenizer");
    let empty: Vec<u32> = (3..vocab_size)
        .filter(|&id| tok.decode(&[id], true).map_or(true, |s| s.is_empty()))
        .collect();
    assert!(
        empty.is_empty(),
        "{}: {} of {vocab_size} ids decode to nothing, e.g. {:?}",
        dir.display(),
        empty.len(),
        &empty[..empty.len().min(10)]
    );
    for id in 0..3 {
        assert!(!tok.decode(&[id], false).expect("decode").is_empty(), "special {id}");
    }
}

#[test]
fn every_id_of_a_tiny_checkpoint_decodes() {
    let out = fresh_dir("vocab-tiny");
    let o = init("qwen3_next", "tiny", &out, &["--layers", "1"]);
    assert!(o.status.success(), "init-model: {}", stderr(&o));
    assert_every_id_decodes(&out);
    let _ = std::fs::remove_dir_all(&out);
}

/// A real-shape checkpoint (131072 ids, a 4096-id trained BPE): about 1.4 GB of weights even with one layer, so it
/// runs on request (`cargo test -p rewind-bin --test cli init_hardening:: -- --ignored`). The unit test
/// `init::tests::every_preset_tokenizer_covers_its_config_vocab` checks every preset's tokenizer without weights.
#[test]
#[ignore = "writes ~1.4 GB"]
fn every_id_of_a_real_shape_checkpoint_decodes() {
    let out = fresh_dir("vocab-real");
    let t = std::time::Instant::now();
    let o = init("nemotron_h", "nemotron-3-nano-30b-a3b", &out, &["--layers", "1"]);
    assert!(o.status.success(), "init-model: {}", stderr(&o));
    eprintln!("init-model: {:.1} s", t.elapsed().as_secs_f64());
    assert_eq!(config(&out)["vocab_size"], 131072);
    assert_every_id_decodes(&out);
    let _ = std::fs::remove_dir_all(&out);
}
