//! Output that cannot be written and out-of-range sizes end cleanly: a closed stdout pipe (`rewind ... | head`) is a
//! quiet exit 0, a full disk (`> /dev/full`, `--out /dev/full`) is one `error:` line naming what could not be written,
//! and `plan-memory --context` / `--budget` and `perplexity --window` outside the model's limits are clear errors
//! rather than panics or silent clamping.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

const PLAN: [&str; 7] = [
    "plan-memory",
    "--arch",
    "nemotron_h",
    "--preset",
    "tiny",
    "--budget",
    "70GiB",
];

/// Runs rewind with `args`, stdout going to `stdout`, stderr captured.
fn rewind_to(args: &[&str], stdout: Stdio) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(args)
        .stdout(stdout)
        .stderr(Stdio::piped())
        .output()
        .expect("run rewind")
}

fn rewind(args: &[&str]) -> Output {
    rewind_to(args, Stdio::piped())
}

/// What the run wrote to stderr, less the note that the model has random weights (the models here are init-model
/// checkpoints; the note is not what these tests are about).
fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .filter(|l| !l.starts_with("note: this model has RANDOM weights"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// A pipe whose reader is already closed: every write to it fails with EPIPE, with no race against the reader.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    Stdio::from(writer)
}

/// `/dev/full`: every write fails with ENOSPC.
#[cfg(target_os = "linux")]
fn dev_full() -> Stdio {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    Stdio::from(f)
}

/// A closed stdout pipe: exit 0, nothing on stderr (no panic, no backtrace, no error line).
fn assert_quiet(o: &Output, what: &str) {
    assert_eq!(
        o.status.code(),
        Some(0),
        "{what}: status {:?}, stderr: {}",
        o.status,
        stderr(o)
    );
    assert!(stderr(o).is_empty(), "{what}: stderr not empty: {}", stderr(o));
}

/// A failure reported as exactly one `error:` line containing every needle, with exit status 1 (not a panic's 101).
fn assert_one_error(o: &Output, what: &str, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{what}: status {:?}, stderr: {err}", o.status);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{what}: want one line on stderr, got: {err}");
    assert!(lines[0].starts_with("error: "), "{what}: {err}");
    for n in needles {
        assert!(err.contains(n), "{what}: stderr lacks `{n}`: {err}");
    }
}

/// A tiny checkpoint in a directory of its own for the test `tag` (tests run in parallel).
fn tiny_model(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rewind-output-errors-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let o = rewind(&[
        "init-model",
        "--arch",
        "nemotron_h",
        "--preset",
        "tiny",
        "--out",
        dir.to_str().expect("utf8"),
        "--seed",
        "5",
    ]);
    assert!(o.status.success(), "init-model failed: {}", stderr(&o));
    dir
}

/// A short text file next to the model in `dir`.
fn text_file(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("text.txt");
    std::fs::write(
        &path,
        "The quick brown fox jumps over the lazy dog. It was the best of times.",
    )
    .expect("write text");
    path
}

#[test]
fn plan_memory_stdout_closed_pipe_is_quiet() {
    let mut json = PLAN.to_vec();
    json.push("--json");
    for args in [PLAN.to_vec(), json] {
        let o = rewind_to(&args, closed_pipe());
        assert_quiet(&o, &format!("{args:?}"));
    }
}

#[cfg(target_os = "linux")]
#[test]
fn plan_memory_stdout_full_is_an_error() {
    let mut json = PLAN.to_vec();
    json.push("--json");
    for args in [PLAN.to_vec(), json] {
        let o = rewind_to(&args, dev_full());
        assert_one_error(&o, &format!("{args:?}"), &["stdout", "No space left"]);
    }
    // The same command with a working stdout prints the table.
    let o = rewind(&PLAN);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("bytes/sequence"));
}

#[test]
fn perplexity_stdout_closed_or_full() {
    let model = tiny_model("ppl-stdout");
    let text = text_file(&model);
    for json in [false, true] {
        let mut args = vec![
            "perplexity",
            "--model",
            model.to_str().expect("utf8"),
            "--file",
            text.to_str().expect("utf8"),
        ];
        if json {
            args.push("--json");
        }
        let o = rewind_to(&args, closed_pipe());
        assert_quiet(&o, &format!("perplexity json={json}, closed pipe"));
        #[cfg(target_os = "linux")]
        {
            let o = rewind_to(&args, dev_full());
            assert_one_error(
                &o,
                &format!("perplexity json={json}, /dev/full"),
                &["stdout", "No space left"],
            );
        }
    }
    let _ = std::fs::remove_dir_all(&model);
}

#[cfg(target_os = "linux")]
#[test]
fn logits_out_full_names_the_file() {
    let model = tiny_model("logits-full");
    let o = rewind(&[
        "logits",
        "--model",
        model.to_str().expect("utf8"),
        "--tokens",
        "5,17,42",
        "--prefill",
        "2",
        "--out",
        "/dev/full",
    ]);
    assert_one_error(&o, "logits --out /dev/full", &["/dev/full", "No space left"]);
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn plan_memory_context_and_budget_bounds() {
    let with = |extra: &[&str]| {
        let mut args = PLAN.to_vec();
        args.extend_from_slice(extra);
        rewind(&args)
    };
    let o = with(&["--context", "0"]);
    assert_one_error(&o, "--context 0", &["--context", "at least 1"]);
    // The tiny preset's max_position_embeddings is 4096.
    let o = with(&["--context", "1000000000"]);
    assert_one_error(
        &o,
        "--context 1000000000",
        &["--context 1000000000", "context limit of 4096"],
    );
    let o = with(&["--context", "4097"]);
    assert_one_error(&o, "--context 4097", &["--context 4097", "context limit of 4096"]);
    let o = with(&["--context", "4096", "--json"]);
    assert!(o.status.success(), "--context 4096: {}", stderr(&o));
    let o = with(&["--context", "1", "--json"]);
    assert!(o.status.success(), "--context 1: {}", stderr(&o));

    let base = &PLAN[..PLAN.len() - 2];
    for budget in [["--budget=-5GiB"].as_slice(), ["--budget", "-5GiB"].as_slice()] {
        let mut args = base.to_vec();
        args.extend_from_slice(budget);
        let o = rewind(&args);
        assert_one_error(&o, &format!("{budget:?}"), &["--budget", "`-5GiB`", "must be positive"]);
        assert!(!stderr(&o).contains("unknown unit"), "{budget:?}: {}", stderr(&o));
    }
}

#[test]
fn perplexity_window_beyond_the_limit_is_an_error() {
    let model = tiny_model("ppl-window");
    let text = text_file(&model);
    let args = |w: &'static str| {
        vec![
            "perplexity".to_string(),
            "--model".into(),
            model.to_str().expect("utf8").into(),
            "--file".into(),
            text.to_str().expect("utf8").into(),
            "--window".into(),
            w.into(),
            "--json".into(),
        ]
    };
    let run = |w: &'static str| {
        let a = args(w);
        rewind(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let o = run("99999");
    assert_one_error(&o, "--window 99999", &["--window 99999", "context limit of 4096"]);
    assert!(o.stdout.is_empty(), "no perplexity printed after the error");
    let o = run("1");
    assert_one_error(&o, "--window 1", &["--window", "at least 2"]);
    // The limit itself is accepted.
    let o = run("4096");
    assert!(o.status.success(), "--window 4096: {}", stderr(&o));
    let _ = std::fs::remove_dir_all(&model);
}

/// A quick `rewind bench` command line for model `m`: a 16-token prompt, 4 decoded tokens, once.
fn small_bench(m: &str) -> Vec<&str> {
    let mut args: Vec<&str> = "bench --prompt-len 16 --decode-tokens 4 --repeats 1 --model"
        .split(' ')
        .collect();
    args.push(m);
    args
}

#[test]
fn bench_and_generate_stdout_closed_or_full() {
    let model = tiny_model("bench-gen-stdout");
    let m = model.to_str().expect("utf8");
    let bench = small_bench(m);
    let runs: [&[&str]; 3] = [
        &bench,
        &["generate", "hi", "--model", m, "--max-tokens", "3"],
        &["generate", "hi", "--model", m, "--max-tokens", "3", "--json"],
    ];
    for args in runs {
        // These commands report progress on stderr, so only the exit and the absence of errors are checked.
        let o = rewind_to(args, closed_pipe());
        let err = stderr(&o);
        assert!(
            o.status.success() && !err.contains("error:") && !err.contains("panicked"),
            "{args:?}, closed pipe: {:?} {err}",
            o.status
        );
        #[cfg(target_os = "linux")]
        {
            let o = rewind_to(args, dev_full());
            let err = stderr(&o);
            let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
            assert!(
                !o.status.success() && !err.contains("panicked"),
                "{args:?}, /dev/full: {err}"
            );
            assert!(
                errors.len() == 1 && errors[0].contains("stdout") && errors[0].contains("No space left"),
                "{args:?}, /dev/full: {err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&model);
}

/// Runs rewind with `args` and `stdin`, stdout and stderr both going to a pipe whose reader is closed (what
/// `rewind ... 2>&1 | head -c 10` leaves once head has exited).
fn rewind_all_closed(args: &[&str], stdin: &str) -> Output {
    use std::io::Write;
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let mut child = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(writer.try_clone().expect("clone the pipe"))
        .stderr(writer)
        .spawn()
        .expect("run rewind");
    // The command may end before it reads its input: a failed write here is no failure of the test.
    let _ = child.stdin.take().expect("stdin").write_all(stdin.as_bytes());
    child.wait_with_output().expect("wait")
}

#[test]
fn a_closed_stderr_panics_nowhere() {
    let model = tiny_model("closed-stderr");
    let m = model.to_str().expect("utf8");
    let bench = small_bench(m);
    let chat: &[&str] = &["chat", "--model", m, "--max-tokens", "4"];
    for (args, stdin, want) in [
        (&bench[..], "", 0),
        (chat, "hello\n/stats\n", 0),
        // clap's own error message, to a closed stderr.
        (&["generate", "--no-such-flag"][..], "", 2),
    ] {
        let o = rewind_all_closed(args, stdin);
        assert_eq!(o.status.code(), Some(want), "{args:?}: {:?}", o.status);
    }

    // A server whose stderr is closed from the start: it serves, and stops cleanly on SIGTERM.
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port()
    };
    let (grpc, http) = (free().to_string(), free().to_string());
    let mut server = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(["serve", "--model", m, "--grpc-port", &grpc, "--http-port", &http])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(closed_pipe())
        .spawn()
        .expect("run rewind serve");
    // The port is bound before the model loads: only an answer shows the server (and its signal handling) is up.
    let port: u16 = http.parse().expect("port");
    let t0 = std::time::Instant::now();
    while !health_answers(port) {
        if let Some(status) = server.try_wait().expect("wait") {
            panic!("the server exited before it answered: {status:?}");
        }
        assert!(t0.elapsed().as_secs() < 90, "the server never answered");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let killed = Command::new("kill")
        .args(["-s", "TERM", &server.id().to_string()])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let status = server.wait().expect("wait");
    assert_eq!(status.code(), Some(0), "serve with a closed stderr: {status:?}");
    let _ = std::fs::remove_dir_all(&model);
}

/// Whether `GET /health` on the loopback `port` answers 200.
fn health_answers(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    let request = format!("GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    let mut answer = String::new();
    s.write_all(request.as_bytes()).is_ok()
        && s.read_to_string(&mut answer).is_ok()
        && answer.starts_with("HTTP/1.1 200")
}
