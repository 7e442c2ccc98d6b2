//! `rewind-launch` end to end on the CPU (two ranks in worker processes): both APIs answer, and SIGTERM with a stream
//! in flight drains — new requests are refused while the stream runs to its end — then the process exits 0 and no
//! worker is left behind; a TP size the
//! model cannot split, and other bad flags, are refused with the reason before anything loads.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::process;
use process::{grpc_health, http, request, tiny_model, Server};

fn launch_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_rewind-launch"))
}

/// `rewind-launch` with `args`: exit success, stderr.
fn launch(args: &[&str]) -> (bool, String) {
    let o = std::process::Command::new(launch_bin())
        .args(args)
        .output()
        .expect("run rewind-launch");
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn sigterm_drains_an_in_flight_stream_then_exits_cleanly() {
    let model = tiny_model("nemotron_h", "launch");
    let m = model.to_str().expect("utf8");
    let name = model.file_name().and_then(|n| n.to_str()).expect("name").to_string();
    let server = Server::start(
        launch_bin(),
        &[
            "--device",
            "cpu",
            "--tp",
            "2",
            "--model",
            m,
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--rank-processes",
        ],
        &[],
    );
    let workers = process::rank_workers(server.pid());
    assert_eq!(workers.len(), 2, "two rank workers expected: {workers:?}");
    let banner = server.stderr();
    for want in [
        "rewind-launch",
        "  tp        2",
        "rank 1",
        "memory    budget",
        "per sequence",
        "api key   off",
    ] {
        assert!(banner.contains(want), "banner lacks {want:?}:\n{banner}");
    }
    let (status, models) = http(server.http, "GET", "/v1/models", &[], None);
    assert_eq!(status, 200, "{models}");
    assert!(models.contains(&format!("\"id\":\"{name}\"")), "{models}");
    assert_eq!(
        grpc_health(server.grpc, None).expect("health"),
        "SERVING_STATUS_SERVING"
    );

    // A long stream, then SIGTERM while it runs.
    let body = format!(
        r#"{{"model":"{name}","prompt":"once upon a time","max_tokens":2000,"ignore_eos":true,"temperature":0,"stream":true}}"#
    );
    let (status, mut stream) = request(server.http, "POST", "/v1/completions", &[], Some(&body));
    assert_eq!(status, 200);
    let first = stream.next_piece().expect("a first event");
    assert!(first.contains("data: "), "{first}");
    let reader = std::thread::spawn(move || stream.rest());
    server.signal("TERM");
    let small = format!(r#"{{"model":"{name}","prompt":"hi","max_tokens":2}}"#);
    let t0 = Instant::now();
    loop {
        let (status, text) = http(server.http, "POST", "/v1/completions", &[], Some(&small));
        if status == 503 {
            break;
        }
        assert_eq!(status, 200, "{text}");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "new requests still taken 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !reader.is_finished(),
        "the stream ended before the drain began: nothing was in flight"
    );
    assert_eq!(
        grpc_health(server.grpc, None).expect("health"),
        "SERVING_STATUS_DRAINING"
    );
    let rest = reader.join().expect("reader");
    assert!(
        rest.contains(r#""finish_reason":"length""#),
        "the stream did not run to its end:\n{rest}"
    );
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let (exit, stderr) = server.wait(Duration::from_secs(60));
    assert!(exit.success(), "exit {exit:?}; stderr:\n{stderr}");
    for want in ["SIGTERM: draining", "drained in", "rewind: stopped", "[rank 1] "] {
        assert!(stderr.contains(want), "stderr lacks {want:?}:\n{stderr}");
    }
    let left = process::wait_gone(&workers, Duration::from_secs(5));
    assert!(left.is_empty(), "rank workers outlived the launcher: {left:?}");
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn sizes_and_flags_that_cannot_work_are_refused_with_the_reason() {
    let model = tiny_model("nemotron_h", "launch-flags");
    let m = model.to_str().expect("utf8");
    // The tiny preset's Mamba-2 layers have 4 heads: 5 ranks cannot each hold one.
    let (ok, err) = launch(&["--device", "cpu", "--tp", "5", "--model", m]);
    assert!(!ok);
    assert!(err.contains("--tp 5 cannot split this model"), "{err}");
    assert!(err.contains("head count (4)"), "{err}");
    for (args, want) in [
        (&["--device", "cpu", "--gpus", "0"][..], "--gpus chooses GPUs"),
        (&["--device", "cpu", "--tp", "0"][..], "--tp must be at least 1"),
        (&["--device", "cpu", "--drain-timeout", "-1"][..], "--drain-timeout"),
        (
            &["--device", "cpu", "--max-model-len", "100000"][..],
            "--max-model-len 100000 exceeds",
        ),
        (&["--gpus", "1,1"][..], "lists GPU 1 twice"),
    ] {
        let mut all = args.to_vec();
        all.extend_from_slice(&["--model", m]);
        let (ok, err) = launch(&all);
        assert!(!ok, "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&model);
}
