//! `rewind bench kernels`: an optional subcommand of `rewind bench` that refuses the CPU, says clearly when there is
//! no CUDA, checks its flags before touching a device, and leaves plain `rewind bench` and its flags as they were.

use crate::common;
use common::{rewind, stderr};

/// Asserts a clean failure (exit code `code`, never a panic) whose stderr contains every one of `needles`.
fn assert_fails(o: &std::process::Output, code: i32, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    assert!(err.contains("error:"), "no error line: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks `{n}`: {err}");
    }
}

#[test]
fn the_cpu_is_refused() {
    let o = rewind(&["bench", "kernels", "--device", "cpu"]);
    assert_fails(&o, 1, &["--device cpu has none", "--device cuda"]);
    let o = rewind(&["bench", "kernels", "--device", "tpu"]);
    assert_fails(&o, 1, &["unknown device `tpu`"]);
}

/// Without a driver (CI) the benchmark is one clear error, the same as every other command's.
#[test]
fn without_a_driver_it_is_a_clear_error() {
    if rewind_engine::gpu::device::device_count().is_ok() {
        eprintln!("a CUDA driver is present: the no-driver path is not exercised here");
        return;
    }
    for args in [
        vec!["bench", "kernels"],
        vec![
            "bench", "kernels", "--device", "cuda:1", "--family", "gdn", "--batch", "1,64",
        ],
    ] {
        assert_fails(&rewind(&args), 1, &["CUDA unavailable"]);
    }
}

#[test]
fn flags_are_checked_before_the_device() {
    assert_fails(
        &rewind(&["bench", "kernels", "--batch", "0"]),
        1,
        &["--batch sizes must lie in 1..="],
    );
    assert_fails(
        &rewind(&["bench", "kernels", "--repeats", "0"]),
        1,
        &["--repeats must be at least 1"],
    );
    assert_fails(&rewind(&["bench", "kernels", "--batch", "1,-2"]), 2, &["non-negative"]);
    assert_fails(
        &rewind(&["bench", "kernels", "--family", "mamba3"]),
        2,
        &["possible values: mamba2, gdn, all"],
    );
}

#[test]
fn model_flags_do_not_mix_with_kernels() {
    let o = rewind(&["bench", "--prompt-len", "8", "kernels"]);
    assert_fails(&o, 2, &["'kernels' cannot be used with '--prompt-len"]);
}

#[test]
fn plain_bench_keeps_its_flags_and_lists_kernels() {
    let o = rewind(&["bench", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    for flag in [
        "--model",
        "--prompt-len",
        "--decode-tokens",
        "--batch",
        "--verify-window",
        "--concurrency",
    ] {
        assert!(help.contains(flag), "bench --help lacks {flag}");
    }
    // The subcommand list pads names to the longest one: the line, not the spacing.
    assert!(
        help.lines().any(|l| l.trim_start().starts_with("kernels ")
            && l.contains("SSM decode kernels of one layer on the GPU")),
        "{help}"
    );
    // A plain bench's own flag errors are unchanged by the subcommand.
    let o = rewind(&["bench", "--batch", "0", "--prompt-len", "1"]);
    assert_fails(&o, 1, &["--prompt-len must be at least 2"]);
}
