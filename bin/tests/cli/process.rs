//! Helpers of the process-level serving tests (`serve_cli`, `launch`): a server binary started on ports the system
//! chooses (read back from its stderr), plain HTTP/1.1 over a socket (no client library), the gRPC client, signals
//! through the `kill` command, and a bounded wait for the exit.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::scratch_dir;
use rewind_bin::serve::grpc::client::connect;
use rewind_bin::serve::grpc::pb;

/// A tiny random checkpoint of `arch` (`rewind init-model --preset tiny`) in a fresh temporary directory named after
/// `tag`.
pub fn tiny_model(arch: &str, tag: &str) -> PathBuf {
    let dir = scratch_dir(tag).join(arch);
    let out = dir.to_str().expect("utf8");
    let o = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(["init-model", "--arch", arch, "--preset", "tiny", "--out", out])
        .output()
        .expect("run init-model");
    assert!(
        o.status.success(),
        "init-model failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    dir
}

/// A running server process.
pub struct Server {
    child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    stderr: Arc<Mutex<String>>,
}

fn listening(line: &str, what: &str) -> Option<SocketAddr> {
    line.strip_prefix(&format!("rewind: {what} listening on "))
        .and_then(|a| a.trim().parse().ok())
}

impl Server {
    /// Starts `bin` with `args` and `env`; waits (at most 90 s) until it prints both listening lines.
    pub fn start(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(bin)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn the server");
        let pipe = child.stderr.take().expect("stderr");
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let (mut grpc, mut http) = (None, None);
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                grpc = grpc.or_else(|| listening(&line, "grpc"));
                http = http.or_else(|| listening(&line, "http"));
                if let Ok(mut s) = sink.lock() {
                    s.push_str(&line);
                    s.push('\n');
                }
                if let (Some(g), Some(h)) = (grpc, http) {
                    let _ = tx.send((g, h));
                    grpc = None;
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(90)) {
            Ok((grpc, http)) => Server {
                child,
                grpc,
                http,
                stderr,
            },
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(200));
                panic!("the server never listened; stderr:\n{}", stderr.lock().expect("lock"));
            }
        }
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `SIGKILL` (no drain, no clean-up: what its workers see when the server is OOM-killed).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// What the server wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().expect("lock").clone()
    }

    /// Sends `signal` (`TERM`, `INT`) with the `kill` command.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill -s {signal} failed");
    }

    /// Waits at most `limit` for the exit; the status and all of stderr.
    pub fn wait(mut self, limit: Duration) -> (ExitStatus, String) {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                // The reader thread ends with the pipe; give it a moment to store the last lines.
                std::thread::sleep(Duration::from_millis(200));
                return (status, self.stderr());
            }
            if t0.elapsed() > limit {
                panic!("the server did not exit within {limit:?}; stderr:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sends one HTTP/1.1 request (`headers`: extra `Name: value` lines); the status and the connection to read the body
/// from.
fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[&str],
    body: Option<&str>,
) -> (u16, BufReader<TcpStream>, bool) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    let body = body.unwrap_or("");
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         {extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut r = BufReader::new(s);
    let mut status_line = String::new();
    r.read_line(&mut status_line).expect("status line");
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut chunked = false;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("header");
        if h.trim().is_empty() {
            break;
        }
        let h = h.to_ascii_lowercase();
        chunked |= h.starts_with("transfer-encoding:") && h.contains("chunked");
    }
    (status, r, chunked)
}

/// The body read so far, chunk by chunk (`Transfer-Encoding: chunked`) or to the end.
pub struct Body {
    r: BufReader<TcpStream>,
    chunked: bool,
    done: bool,
}

impl Body {
    /// The next piece of the body; `None` at its end.
    pub fn next_piece(&mut self) -> Option<String> {
        if self.done {
            return None;
        }
        if !self.chunked {
            let mut all = String::new();
            let _ = self.r.read_to_string(&mut all);
            self.done = true;
            return Some(all);
        }
        let mut size = String::new();
        if self.r.read_line(&mut size).unwrap_or(0) == 0 {
            self.done = true;
            return None;
        }
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or_else(|_| panic!("bad chunk size {size:?}"));
        let mut data = vec![0u8; n + 2];
        self.r.read_exact(&mut data).expect("chunk");
        if n == 0 {
            self.done = true;
            return None;
        }
        data.truncate(n);
        Some(String::from_utf8_lossy(&data).into_owned())
    }

    /// The rest of the body.
    pub fn rest(&mut self) -> String {
        let mut all = String::new();
        while let Some(p) = self.next_piece() {
            all.push_str(&p);
        }
        all
    }
}

/// An HTTP request; the status and the body, to read as it comes.
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[&str], body: Option<&str>) -> (u16, Body) {
    let (status, r, chunked) = send(addr, method, path, headers, body);
    (
        status,
        Body {
            r,
            chunked,
            done: false,
        },
    )
}

/// An HTTP request read to its end: the status and the body.
pub fn http(addr: SocketAddr, method: &str, path: &str, headers: &[&str], body: Option<&str>) -> (u16, String) {
    let (status, mut b) = request(addr, method, path, headers, body);
    (status, b.rest())
}

/// The gRPC `Health` status of the server at `addr` (as the enum's name), or the call's error.
pub fn grpc_health(addr: SocketAddr, api_key: Option<&str>) -> Result<String, tonic::Status> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut c = connect(&format!("http://{addr}"), api_key).await.expect("connect");
        let h = c.health(pb::HealthRequest {}).await?.into_inner();
        Ok(h.status().as_str_name().to_string())
    })
}

/// The gRPC `Health` status of the server at `addr` without an API key, or why the connection or the call failed.
pub fn grpc_health_result(addr: SocketAddr) -> Result<String, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut c = connect(&format!("http://{addr}"), None)
            .await
            .map_err(|e| format!("{e:#}"))?;
        let h = c
            .health(pb::HealthRequest {})
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        Ok(h.status().as_str_name().to_string())
    })
}

/// The rank worker processes (`rewind rank-worker`) whose parent is `pid`.
pub fn rank_workers(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // `pid (comm) state ppid ...`: the command may hold spaces, so fields are read after its `)`.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            ppid == Some(pid) && String::from_utf8_lossy(&cmd).contains("rank-worker")
        })
        .collect()
}

/// Whether process `pid` is still running (a zombie, dead but not yet reaped, counts as gone).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                != Some("Z")
        }
        Err(_) => false,
    }
}

/// Waits (at most `limit`) until none of `pids` runs; the ones still running then.
pub fn wait_gone(pids: &[u32], limit: Duration) -> Vec<u32> {
    let t0 = Instant::now();
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() || t0.elapsed() > limit {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
