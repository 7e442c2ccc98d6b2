//! `rewind generate` through the serving engine, end to end: greedy tokens at `--tp 1|2|3` equal, every
//! `--inject-fault` kind recovered with the same tokens (and reported on stderr), bad engine flags clear errors.
//! `rewind serve` as a process: both APIs on ports the system picks (flags and environment), the API key, a clean
//! exit on SIGTERM; `rewind chat` on its in-process server with piped stdin: turns, `/fork`, `/stats`. Ranks in
//! worker processes (`--rank-processes`): the same tokens as rank threads under 32 concurrent requests, through a
//! worker SIGKILLed mid-decode, and no worker left behind by any way the server ends.

use std::path::Path;
use std::time::Duration;

use crate::common;
use crate::process;
use common::{rewind, rewind_stdin, stderr};

/// Greedy tokens of `generate --json` with `extra` flags, and its stderr.
fn tokens(model: &Path, extra: &[&str]) -> (Vec<u64>, String) {
    let mut args = vec![
        "generate",
        "the quick brown fox",
        "--model",
        model.to_str().expect("utf8"),
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = rewind(&args);
    assert!(o.status.success(), "generate {extra:?} failed: {}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let t = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id"))
        .collect();
    (t, stderr(&o))
}

#[test]
fn generate_is_the_same_at_every_tp_and_through_every_fault() {
    for arch in ["nemotron_h", "qwen3_5"] {
        let model = process::tiny_model(arch, "serve-cli");
        let (want, _) = tokens(&model, &[]);
        assert_eq!(want.len(), 12);
        for tp in ["2", "3"] {
            assert_eq!(tokens(&model, &["--tp", tp]).0, want, "{arch} at --tp {tp}");
        }
        for kind in ["panic", "hang", "error", "nan"] {
            let spec = format!("1:{kind}@5");
            let (got, err) = tokens(&model, &["--tp", "2", "--inject-fault", &spec, "--step-timeout", "3"]);
            assert_eq!(got, want, "{arch} with {spec}");
            assert!(err.contains("[recovered from a fault"), "{arch} {spec}: {err}");
        }
        let _ = std::fs::remove_dir_all(&model);
    }
}

#[test]
fn bad_engine_flags_are_clear_errors() {
    for (flags, want) in [
        (&["--inject-fault", "0:boom@3"][..], "RANK:KIND@STEP"),
        (&["--inject-fault", "2:panic@3"][..], "rank 2 does not exist"),
        (&["--max-batch-tokens", "0"][..], "--max-batch-tokens"),
        (&["--step-timeout", "0"][..], "--step-timeout"),
    ] {
        let mut args = vec!["generate", "hi", "--max-tokens", "2"];
        args.extend_from_slice(flags);
        let o = rewind(&args);
        assert!(!o.status.success(), "{flags:?} accepted");
        let err = stderr(&o);
        assert!(err.contains(want) && !err.contains("panicked"), "{flags:?}: {err}");
    }
}

#[test]
fn serve_answers_both_apis_and_stops_on_sigterm() {
    let model = process::tiny_model("nemotron_h", "serve-process");
    let m = model.to_str().expect("utf8");
    // Ports and key from the environment, as a container would set them; --served-model-name from a flag.
    let server = process::Server::start(
        Path::new(env!("CARGO_BIN_EXE_rewind")),
        &[
            "serve",
            "--model",
            m,
            "--served-model-name",
            "tiny-test",
            "--default-max-tokens",
            "3",
        ],
        &[
            ("REWIND_GRPC_PORT", "0"),
            ("REWIND_HTTP_PORT", "0"),
            ("REWIND_API_KEY", "sesame"),
        ],
    );
    let (status, _) = process::http(server.http, "GET", "/v1/models", &[], None);
    assert_eq!(status, 401, "the API key is not required");
    let (status, models) = process::http(
        server.http,
        "GET",
        "/v1/models",
        &["Authorization: Bearer sesame"],
        None,
    );
    assert_eq!(status, 200, "{models}");
    assert!(models.contains(r#""id":"tiny-test""#), "{models}");
    // A request without max_tokens generates --default-max-tokens.
    let (status, done) = process::http(
        server.http,
        "POST",
        "/v1/completions",
        &["Authorization: Bearer sesame", "Content-Type: application/json"],
        Some(r#"{"prompt": [5, 6, 7], "ignore_eos": true}"#),
    );
    assert_eq!(status, 200, "{done}");
    assert!(done.contains(r#""completion_tokens":3"#), "{done}");
    let denied = process::grpc_health(server.grpc, None).expect_err("health without the key");
    assert_eq!(denied.code(), tonic::Code::Unauthenticated);
    assert_eq!(
        process::grpc_health(server.grpc, Some("sesame")).expect("health"),
        "SERVING_STATUS_SERVING"
    );
    server.signal("TERM");
    let (exit, err) = server.wait(Duration::from_secs(30));
    assert!(exit.success(), "exit {exit:?}:\n{err}");
    assert!(
        err.contains("SIGTERM: draining") && err.contains("rewind: stopped"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn chat_runs_turns_forks_and_stats_from_piped_stdin() {
    let model = process::tiny_model("qwen3_5", "chat-cli");
    // stdin closes at its end: the chat ends there, closing its session and stopping its server.
    let o = chat(
        &model,
        &["--system", "Be brief.", "--max-tokens", "6", "--seed", "7"],
        "hello there\nhow are you?\n/fork\nand after the fork?\n/stats\n",
    );
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "chat failed:\n{out}\n{err}");
    let turns: Vec<&str> = err.lines().filter(|l| l.contains(" tokens | finish: ")).collect();
    assert_eq!(turns.len(), 3, "three turns expected:\n{err}");
    // The fork line names both sessions; the stats show the fork, holding the three turns' tokens.
    let fork = out
        .lines()
        .find(|l| l.starts_with("forked "))
        .unwrap_or_else(|| panic!("no fork line:\n{out}"));
    let ids: Vec<&str> = fork.split_whitespace().filter(|w| w.starts_with("sess-")).collect();
    assert!(ids.len() >= 2 && ids[0] != ids[1], "{fork}");
    let session = out
        .lines()
        .find(|l| l.starts_with("session "))
        .unwrap_or_else(|| panic!("no stats:\n{out}"));
    assert!(session.starts_with(&format!("session {}:", ids[1])), "{session}");
    assert!(session.contains(&format!("forked from {}", ids[0])), "{session}");
    let tokens: u64 = session
        .split_whitespace()
        .nth(2)
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{session}"));
    assert!(
        tokens > 3 * 6,
        "the session holds every turn's prompt and reply: {session}"
    );
    assert!(out.contains("server: model "), "{out}");
    // The fork has had one turn: a singular noun ("1 turns" before).
    assert!(session.contains(" tokens, 1 turn, forked from"), "{session}");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn a_port_in_use_is_reported_before_the_model_loads() {
    let model = process::tiny_model("nemotron_h", "serve-port");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let o = rewind(&[
        "serve",
        "--model",
        model.to_str().expect("utf8"),
        "--grpc-port",
        &port,
        "--http-port",
        "0",
    ]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains(&format!("binding the gRPC server to 127.0.0.1:{port}")),
        "{err}"
    );
    // Nothing was loaded: the engine's summary line never came.
    assert!(!err.contains("rewind: serving"), "{err}");
}

/// A default max_tokens of 0 would make every request that sets none generate nothing: refused by the flag.
#[test]
fn a_zero_default_max_tokens_is_refused() {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args([
            "serve",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--default-max-tokens",
            "0",
        ])
        .output()
        .expect("run rewind serve");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("--default-max-tokens"), "{err}");
}

/// An empty API key is refused rather than quietly serving without one (fuzzing finding).
#[test]
fn an_empty_api_key_is_refused() {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(["serve", "--grpc-port", "0", "--http-port", "0", "--api-key", ""])
        .output()
        .expect("run rewind serve");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("--api-key is empty"), "{err}");
}

/// A session memory budget that is not a positive amount of memory is refused by the flag, saying why.
#[test]
fn a_bad_session_memory_is_refused() {
    for (value, says) in [
        ("0", "at least 1 byte"),
        ("lots", "not an amount of memory"),
        ("8 gigs", "unknown unit"),
    ] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_rewind"))
            .args([
                "serve",
                "--grpc-port",
                "0",
                "--http-port",
                "0",
                "--session-memory",
                value,
            ])
            .output()
            .expect("run rewind serve");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{err}");
        assert!(err.contains("--session-memory") && err.contains(says), "{value}: {err}");
    }
}

/// `rewind serve` on the embedded default model with `extra` flags, a long stream opened on it (its first event
/// read), and the reader of the rest of that stream.
fn serve_with_a_stream_in_flight(extra: &[&str]) -> (process::Server, std::thread::JoinHandle<String>) {
    let mut args = vec![
        "serve",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--served-model-name",
        "m",
    ];
    args.extend_from_slice(extra);
    let server = process::Server::start(Path::new(env!("CARGO_BIN_EXE_rewind")), &args, &[]);
    let body = r#"{"model":"m","prompt":"once upon a time","max_tokens":3000,"ignore_eos":true,"stream":true}"#;
    let (status, mut stream) = process::request(server.http, "POST", "/v1/completions", &[], Some(body));
    assert_eq!(status, 200);
    let first = stream.next_piece().expect("a first event");
    assert!(first.contains("data: "), "{first}");
    (server, std::thread::spawn(move || stream.rest()))
}

/// What a forced stop must leave: exit 0 within a few seconds, no panic, and the stream ended by an error event
/// then `[DONE]`.
fn assert_forced_stop_is_clean(server: process::Server, reader: std::thread::JoinHandle<String>) {
    let (exit, err) = server.wait(Duration::from_secs(8));
    assert!(exit.success(), "exit {exit:?}:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    let rest = reader.join().expect("reader");
    assert!(
        rest.contains(r#"{"error":"#) && rest.contains("shutting down without waiting"),
        "the stream did not end with an error event:\n{rest}"
    );
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    assert!(
        !rest.contains(r#""finish_reason":"length""#),
        "the stream ran to its end: nothing was cut off"
    );
}

#[test]
fn a_second_sigterm_ends_in_flight_streams_with_an_error_and_exits_0() {
    let (server, reader) = serve_with_a_stream_in_flight(&[]);
    server.signal("TERM");
    // The second signal only counts once the first one's drain has begun.
    let t0 = std::time::Instant::now();
    while !server.stderr().contains("SIGTERM: draining") {
        assert!(t0.elapsed() < Duration::from_secs(10), "no drain:\n{}", server.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    server.signal("TERM");
    assert_forced_stop_is_clean(server, reader);
}

#[test]
fn a_drain_timeout_ends_in_flight_streams_with_an_error_and_exits_0() {
    let (server, reader) = serve_with_a_stream_in_flight(&["--drain-timeout", "0.5"]);
    server.signal("TERM");
    assert_forced_stop_is_clean(server, reader);
}

#[test]
fn max_seqs_sizes_a_cpu_server_even_at_the_gpu_default() {
    // 64 is the flag's GPU default: a server told 64 must not fall back to the CPU default of 8.
    for (flags, want) in [(&["--max-seqs", "64"][..], "64 sequences"), (&[][..], "8 sequences")] {
        let mut args = vec!["serve", "--grpc-port", "0", "--http-port", "0"];
        args.extend_from_slice(flags);
        let server = process::Server::start(Path::new(env!("CARGO_BIN_EXE_rewind")), &args, &[]);
        let banner = server.stderr();
        server.signal("TERM");
        let (exit, err) = server.wait(Duration::from_secs(30));
        assert!(exit.success(), "exit {exit:?}:\n{err}");
        assert!(banner.contains(want), "{flags:?}: the banner lacks {want:?}:\n{banner}");
    }
}

/// `rewind chat` on `model` with `extra` flags, `input` piped to its stdin.
fn chat(model: &Path, extra: &[&str], input: &str) -> std::process::Output {
    let mut args = vec!["chat", "--model", model.to_str().expect("utf8")];
    args.extend_from_slice(extra);
    rewind_stdin(&args, input)
}

/// One chat turn with `extra` flags on `model`: the exit and stderr.
fn chat_once(model: &Path, extra: &[&str]) -> (bool, String) {
    let mut args = vec!["--max-tokens", "3"];
    args.extend_from_slice(extra);
    let o = chat(model, &args, "hello\n");
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn chat_takes_top_p_and_top_k_as_generate_does() {
    let model = process::tiny_model("qwen3_5", "chat-top-p");
    let (ok, err) = chat_once(&model, &["--top-p", "0.5", "--top-k", "3"]);
    assert!(ok && err.contains(" tokens | finish: "), "{err}");
    // The value reaches the server, whose check names it.
    let (_, err) = chat_once(&model, &["--top-p", "2"]);
    assert!(err.contains("top_p"), "{err}");
    let _ = std::fs::remove_dir_all(&model);
}

/// `rewind chat --addr` needs no model directory: the server renders the turns with its own template and
/// tokenizer, and a model directory given beside it is not read (a note says so).
#[test]
fn chat_with_addr_uses_the_servers_model() {
    let model = process::tiny_model("qwen3_5", "chat-addr");
    let server = process::Server::start(
        Path::new(env!("CARGO_BIN_EXE_rewind")),
        &[
            "serve",
            "--model",
            model.to_str().expect("utf8"),
            "--grpc-port",
            "0",
            "--http-port",
            "0",
        ],
        &[],
    );
    let addr = format!("http://{}", server.grpc);
    let o = rewind_stdin(
        &["chat", "--addr", &addr, "--max-tokens", "4", "--seed", "1"],
        "hello <|im_start|>system\nagain\n",
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches(" tokens | finish: ").count(), 2, "{err}");
    let o = rewind_stdin(
        &["chat", "--addr", &addr, "--model", "/no/such/dir", "--max-tokens", "2"],
        "hi\n",
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("--model /no/such/dir is not read"), "{err}");
    server.signal("TERM");
    let (exit, err) = server.wait(Duration::from_secs(30));
    assert!(exit.success(), "{err}");
    let _ = std::fs::remove_dir_all(&model);
}

/// Greedy completions of 32 different prompts sent at once to `server`, in prompt order.
fn completions_at_once(server: &process::Server) -> Vec<String> {
    let addr = server.http;
    let handles: Vec<_> = (0..32u32)
        .map(|i| {
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"prompt": [{}, {}, {}, 7], "max_tokens": 10, "temperature": 0, "ignore_eos": true}}"#,
                    5 + i,
                    40 + i % 7,
                    90 + i % 3
                );
                let (status, done) = process::http(
                    addr,
                    "POST",
                    "/v1/completions",
                    &["Content-Type: application/json"],
                    Some(&body),
                );
                assert_eq!(status, 200, "prompt {i}: {done}");
                let v: serde_json::Value = serde_json::from_str(&done).expect("json");
                assert_eq!(v["usage"]["completion_tokens"], 10, "{done}");
                v["choices"][0]["text"].as_str().expect("text").to_string()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("request")).collect()
}

fn serve_tp2(model: &Path, extra: &[&str]) -> process::Server {
    let mut args = vec![
        "serve",
        "--model",
        model.to_str().expect("utf8"),
        "--tp",
        "2",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--max-seqs",
        "16",
    ];
    args.extend_from_slice(extra);
    process::Server::start(Path::new(env!("CARGO_BIN_EXE_rewind")), &args, &[])
}

#[test]
fn rank_processes_serve_the_same_tokens_through_a_killed_worker_and_leave_no_orphans() {
    let model = process::tiny_model("nemotron_h", "rank-processes");
    let threads = serve_tp2(&model, &[]);
    let want = completions_at_once(&threads);
    threads.signal("TERM");
    threads.wait(Duration::from_secs(30));

    // Worker processes, fault-free: the same tokens; SIGTERM drains and stops every worker.
    let procs = serve_tp2(&model, &["--rank-processes"]);
    let workers = process::rank_workers(procs.pid());
    assert_eq!(
        workers.len(),
        2,
        "two workers expected: {workers:?}\n{}",
        procs.stderr()
    );
    assert_eq!(completions_at_once(&procs), want, "worker processes");
    procs.signal("TERM");
    let (exit, err) = procs.wait(Duration::from_secs(30));
    assert!(exit.success(), "exit {exit:?}:\n{err}");
    // Worker logs come prefixed with their rank.
    assert!(err.contains("[rank 1] "), "{err}");
    assert_eq!(
        process::wait_gone(&workers, Duration::from_secs(5)),
        Vec::<u32>::new(),
        "orphans after SIGTERM"
    );

    // Rank 1's worker SIGKILLs itself, or aborts, mid-decode: fresh workers are started and every request completes
    // as without the fault.
    for (kind, step) in [("kill", 12), ("abort", 20)] {
        let spec = format!("1:{kind}@{step}");
        let mut faulty = serve_tp2(
            &model,
            &["--rank-processes", "--inject-fault", &spec, "--step-timeout", "10"],
        );
        let first = process::rank_workers(faulty.pid());
        assert_eq!(completions_at_once(&faulty), want, "through {spec}");
        let err = faulty.stderr();
        assert!(
            err.contains("restarting the ranks") && err.contains(&format!("kind={kind}")),
            "{spec}: no recovery logged:\n{err}"
        );
        let (status, health) = process::http(faulty.http, "GET", "/health", &[], None);
        assert_eq!(status, 200, "{health}");
        assert!(health.contains(r#""worker_restarts":[1,1]"#), "{spec}: {health}");
        let (_, metrics) = process::http(faulty.http, "GET", "/metrics", &[], None);
        assert!(
            metrics.contains(r#"rewind_rank_worker_restarts{rank="1"} 1"#),
            "{metrics}"
        );
        let now = process::rank_workers(faulty.pid());
        assert_eq!(now.len(), 2, "{now:?}");
        assert!(
            now.iter().all(|p| !first.contains(p)),
            "{spec}: not replaced: {first:?} -> {now:?}"
        );
        // The server SIGKILLed: its workers die with it (PR_SET_PDEATHSIG, and their stdin pipe closes).
        faulty.kill();
        let left = process::wait_gone(&now, Duration::from_secs(5));
        assert!(left.is_empty(), "orphans after SIGKILL of the server: {left:?}");
    }
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn rank_process_flags_are_checked() {
    for (flags, want) in [
        (&["--inject-fault", "0:kill@3"][..], "--rank-processes"),
        (&["--inject-fault", "0:abort@3", "--tp", "2"][..], "--rank-processes"),
        (
            &["--rank-processes", "--device", "cuda"][..],
            "--rank-processes runs CPU ranks",
        ),
    ] {
        let mut args = vec!["serve", "--grpc-port", "0", "--http-port", "0"];
        args.extend_from_slice(flags);
        let o = rewind(&args);
        assert!(!o.status.success(), "{flags:?} accepted");
        let err = stderr(&o);
        assert!(err.contains(want) && !err.contains("panicked"), "{flags:?}: {err}");
    }
}
