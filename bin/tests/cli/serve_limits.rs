//! `rewind serve`'s bounds on its clients, as a process over raw sockets: a slow client's headers (slowloris), an
//! idle keep-alive connection, a slow body and the gRPC preface are cut off after their timeouts; a body or gRPC
//! message past `--max-request-bytes` is refused before it is read; connections past `--max-connections` are
//! refused while the ones held are still served; every refusal is counted in `/metrics`; bad values are clear errors.
//!
//! Timeouts are 1 s and the waits for them 20 s, so a loaded machine cannot make a check flake; what is checked is
//! that the server closed or answered, not how fast.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common;
use crate::process;
use common::{rewind, stderr};
use rewind_bin::serve::grpc::client::connect;
use rewind_bin::serve::grpc::pb;

/// How long a check waits for the server to close or answer.
const PATIENCE: Duration = Duration::from_secs(20);

fn serve(tag: &str, flags: &[&str]) -> (process::Server, std::path::PathBuf) {
    let model = process::tiny_model("nemotron_h", tag);
    let m = model.to_str().expect("utf8").to_string();
    let mut args = vec!["serve", "--model", &m, "--grpc-port", "0", "--http-port", "0"];
    args.extend_from_slice(flags);
    let server = process::Server::start(Path::new(env!("CARGO_BIN_EXE_rewind")), &args, &[]);
    (server, model)
}

fn connect_to(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(PATIENCE)).expect("timeout");
    s
}

/// Reads until the server closes the connection; what it sent. Panics when it is still open after [`PATIENCE`].
fn until_closed(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("the server kept the connection open for {PATIENCE:?}")
            }
            // A reset is a close too.
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Reads one response with a `Content-Length` body off a kept-alive connection: the status line and the body.
fn response(r: &mut BufReader<TcpStream>) -> (String, String) {
    let mut status = String::new();
    r.read_line(&mut status).expect("status line");
    let mut len = 0;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("header");
        if h.trim().is_empty() {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().expect("length");
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).expect("body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

fn metrics(addr: SocketAddr) -> String {
    let (status, text) = process::http(addr, "GET", "/metrics", &[], None);
    assert_eq!(status, 200, "{text}");
    text
}

/// The value of the metric line that starts with `series`.
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

#[test]
fn slow_idle_and_oversized_clients_are_cut_off_and_counted() {
    let (server, model) = serve(
        "limits-timeouts",
        &[
            "--header-timeout",
            "1",
            "--keep-alive-timeout",
            "1",
            "--body-timeout",
            "1",
            "--max-request-bytes",
            "4096",
        ],
    );

    // Slowloris: headers begun and never finished.
    let mut slow = connect_to(server.http);
    let t0 = Instant::now();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: app")
        .expect("write");
    until_closed(&mut slow);
    assert!(t0.elapsed() >= Duration::from_millis(900), "closed before the timeout");

    // An idle keep-alive connection, after one request answered on it.
    let mut idle = connect_to(server.http);
    write!(idle, "GET /v1/models HTTP/1.1\r\nHost: {}\r\n\r\n", server.http).expect("write");
    let mut r = BufReader::new(idle.try_clone().expect("clone"));
    let (status, body) = response(&mut r);
    assert!(status.contains(" 200 "), "{status} {body}");
    let t0 = Instant::now();
    let rest = until_closed(&mut idle);
    assert!(rest.is_empty(), "{rest}");
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "closed before the keep-alive timeout"
    );

    // A body that stops halfway: a 408 naming the flag.
    let mut slow_body = connect_to(server.http);
    write!(
        slow_body,
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n\
         {{\"prompt\": ",
        server.http
    )
    .expect("write");
    let answer = until_closed(&mut slow_body);
    assert!(
        answer.starts_with("HTTP/1.1 408") && answer.contains("--body-timeout"),
        "{answer}"
    );

    // A body past --max-request-bytes: a 413 from its Content-Length, naming the limit.
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(5000));
    let (status, text) = process::http(server.http, "POST", "/v1/completions", &[], Some(&big));
    assert_eq!(status, 413, "{text}");
    assert!(
        text.contains("4 KiB") && text.contains("--max-request-bytes") && text.contains("request_too_large"),
        "{text}"
    );

    // The server still answers a well-behaved client.
    let (status, text) = process::http(
        server.http,
        "POST",
        "/v1/completions",
        &[],
        Some(r#"{"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": true}"#),
    );
    assert_eq!(status, 200, "{text}");

    // gRPC: a connection that never sends the HTTP/2 preface is closed; a message past the limit is refused.
    let mut silent = connect_to(server.grpc);
    until_closed(&mut silent);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let refused = rt.block_on(async {
        let mut c = connect(&format!("http://{}", server.grpc), None)
            .await
            .expect("connect");
        c.tokenize(pb::TokenizeRequest {
            text: vec![b'a'; 5000],
            add_special_tokens: false,
        })
        .await
        .expect_err("a message past --max-request-bytes")
    });
    assert!(
        refused.message().contains("4096"),
        "{:?}: {}",
        refused.code(),
        refused.message()
    );

    let m = metrics(server.http);
    assert!(
        metric(
            &m,
            "rewind_connections_timed_out_total{server=\"http\",reason=\"header_timeout\"}"
        ) >= 1.0
    );
    assert!(
        metric(
            &m,
            "rewind_connections_timed_out_total{server=\"http\",reason=\"idle_timeout\"}"
        ) >= 1.0
    );
    assert!(
        metric(
            &m,
            "rewind_connections_timed_out_total{server=\"grpc\",reason=\"header_timeout\"}"
        ) >= 1.0
    );
    assert_eq!(
        metric(&m, "rewind_http_bodies_refused_total{reason=\"too_large\"}"),
        1.0
    );
    assert_eq!(metric(&m, "rewind_http_bodies_refused_total{reason=\"timeout\"}"), 1.0);
    drop(server);
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn connections_past_the_cap_are_refused_while_the_held_ones_are_served() {
    let (server, model) = serve("limits-cap", &["--max-connections", "2"]);

    // HTTP: two connections held (one kept alive after a request), the third refused with a 503.
    let held = connect_to(server.http);
    let mut r = BufReader::new(held.try_clone().expect("clone"));
    let mut held_w = held;
    write!(held_w, "GET /v1/models HTTP/1.1\r\nHost: {}\r\n\r\n", server.http).expect("write");
    assert!(response(&mut r).0.contains(" 200 "));
    let second = connect_to(server.http);
    let mut third = connect_to(server.http);
    let answer = until_closed(&mut third);
    assert!(
        answer.starts_with("HTTP/1.1 503")
            && answer.contains("too_many_connections")
            && answer.contains("2 connections"),
        "{answer}"
    );
    // The held connection is still served.
    write!(held_w, "GET /v1/models HTTP/1.1\r\nHost: {}\r\n\r\n", server.http).expect("write");
    let (status, body) = response(&mut r);
    assert!(status.contains(" 200 "), "{status} {body}");
    // Once one closes, a new client gets in.
    drop(second);
    let t0 = Instant::now();
    let m = loop {
        let mut s = connect_to(server.http);
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            server.http
        )
        .expect("write");
        let text = until_closed(&mut s);
        if text.starts_with("HTTP/1.1 200") {
            break text;
        }
        assert!(t0.elapsed() < PATIENCE, "no room after a connection closed: {text}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        metric(&m, "rewind_connections_refused_total{server=\"http\"}") >= 1.0,
        "{m}"
    );
    drop((held_w, r));

    // gRPC: two connections held, a call on a third fails; once they close, calls go through.
    let a = connect_to(server.grpc);
    let b = connect_to(server.grpc);
    // The server has taken both before the third arrives (accepts are in order).
    std::thread::sleep(Duration::from_millis(200));
    let refused = process::grpc_health_result(server.grpc).expect_err("a third gRPC connection");
    assert!(!refused.is_empty());
    drop((a, b));
    let t0 = Instant::now();
    while process::grpc_health_result(server.grpc).is_err() {
        assert!(
            t0.elapsed() < PATIENCE,
            "gRPC calls still refused after the held connections closed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn bad_limit_values_are_clear_errors() {
    for (flag, value, want) in [
        ("--max-connections", "0", "--max-connections"),
        (
            "--header-timeout",
            "0",
            "--header-timeout must be a positive number of seconds",
        ),
        (
            "--keep-alive-timeout",
            "-1",
            "--keep-alive-timeout must be a positive number of seconds",
        ),
        ("--body-timeout", "nan", "--body-timeout"),
        ("--max-request-bytes", "10", "--max-request-bytes"),
    ] {
        let o = rewind(&["serve", "--grpc-port", "0", "--http-port", "0", flag, value]);
        assert!(!o.status.success(), "{flag} {value} accepted");
        let err = stderr(&o);
        assert!(err.contains(want) && !err.contains("panicked"), "{flag} {value}: {err}");
    }
}
