//! Helpers shared by the CLI integration tests: run the `rewind` binary and read what it wrote.

// Not every test module uses every helper.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh empty directory under the system's temporary directory, its own for every call: the tests of all modules
/// run as threads of one process, so the process id alone does not tell two tests' files apart.
pub fn scratch_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("rewind-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}

/// Runs `rewind` with `args` and collects its output.
pub fn rewind(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(args)
        .output()
        .expect("run rewind")
}

/// What the run wrote to stderr.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// Runs `rewind` with `args` and `input` on its stdin, and collects its output.
pub fn rewind_stdin(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rewind");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("wait rewind")
}

/// The embedded default Qwen3.5 model with its MTP layer switched off in `config.json` (the tensors stay and are
/// ignored): a checkpoint `--spec mtp` must refuse. Everything but the config is linked, not copied.
pub fn default_model_without_mtp() -> tempfile::TempDir {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/default/qwen3_5");
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(&src).expect("default model") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("file name").to_owned();
        if name == "config.json" {
            let mut config: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("config JSON");
            config.as_object_mut().expect("object").remove("mtp_num_hidden_layers");
            std::fs::write(dir.path().join(name), config.to_string()).expect("write config");
        } else {
            std::os::unix::fs::symlink(&path, dir.path().join(name)).expect("link");
        }
    }
    dir
}
