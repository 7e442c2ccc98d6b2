//! [`TcpComm`]: the collectives between CPU ranks that live in different processes (`--rank-processes`), over TCP.
//!
//! Rank 0 is the hub: it opens a [`TcpRendezvous`] (a listening socket whose address the coordinator hands to the
//! other ranks' workers through the cluster, as an NCCL unique id would be), and every other rank connects to it once.
//! A collective is one round trip per rank: each leaf sends its contribution, the hub waits for all of them, combines
//! them in rank order — the order [`super::LocalComm`] sums in, so processes and threads compute bit-identical
//! results — and sends every leaf the result. Ranks that disagree on the collective get an error (as with
//! `LocalComm`), and a rank whose peer died gets one too: the dead process's sockets close.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::comm::Communicator;
use crate::error::{EngineError, Result};

/// The first word of every rank's greeting, so a stray connection is refused rather than read as a rank.
const HELLO: u32 = 0x7265_7731;

/// Operation tags on the wire.
const ALL_REDUCE: u8 = 1;
const ALL_GATHER: u8 = 2;
const BARRIER: u8 = 3;

/// The hub's answer: the result follows.
const OK: u8 = 0;
/// The hub's answer: the ranks entered different collectives; nothing follows.
const MISMATCH: u8 = 1;

#[derive(Default)]
struct AbortState {
    reason: Option<String>,
    /// Clones of every socket of this rank's links: shutting them down wakes a rank blocked in a read.
    streams: Vec<TcpStream>,
}

/// Aborts one rank's links from any thread: every pending and later collective of that rank fails, and its peers'
/// collectives fail too (their sockets close). Cloning shares the handle.
#[derive(Clone, Default)]
pub struct TcpAbort {
    inner: Arc<Mutex<AbortState>>,
}

impl TcpAbort {
    /// A handle with no links yet; links registered after an abort are shut down at once.
    pub fn new() -> Self {
        Self::default()
    }

    /// Aborts with `reason` (the first reason wins).
    pub fn abort(&self, reason: &str) {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        st.reason.get_or_insert_with(|| reason.to_string());
        for s in &st.streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    fn reason(&self) -> Option<String> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).reason.clone()
    }

    fn register(&self, stream: &TcpStream) -> Result<()> {
        let clone = stream.try_clone().map_err(|e| comm_err("cloning a link", &e))?;
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &st.reason {
            let _ = clone.shutdown(std::net::Shutdown::Both);
            return Err(EngineError::Communicator(format!("group aborted ({why})")));
        }
        st.streams.push(clone);
        Ok(())
    }
}

fn comm_err(what: &str, e: &std::io::Error) -> EngineError {
    EngineError::Communicator(format!("{what}: {e}"))
}

/// Rank 0's listening socket, opened before the other ranks are told where to connect.
pub struct TcpRendezvous {
    listener: TcpListener,
    addr: SocketAddr,
}

impl TcpRendezvous {
    /// Listens on an ephemeral port of `ip` (loopback when every rank is on this host).
    pub fn bind(ip: IpAddr) -> Result<Self> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| comm_err(&format!("listening on {ip}"), &e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| comm_err("reading the rendezvous address", &e))?;
        Ok(TcpRendezvous { listener, addr })
    }

    /// Where the other ranks connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits (up to `timeout`, or until `abort`) for ranks `1..size` to connect; returns rank 0's communicator.
    pub fn accept(self, size: usize, abort: &TcpAbort, timeout: Duration) -> Result<TcpComm> {
        let until = Instant::now() + timeout;
        // Polled, so that an abort or the deadline ends a wait for a rank that never comes.
        self.listener
            .set_nonblocking(true)
            .map_err(|e| comm_err("configuring the rendezvous", &e))?;
        let mut peers: Vec<Option<TcpStream>> = (1..size).map(|_| None).collect();
        while peers.iter().any(Option::is_none) {
            if let Some(why) = abort.reason() {
                return Err(EngineError::Communicator(format!("group aborted ({why})")));
            }
            match self.listener.accept() {
                Ok((stream, from)) => {
                    stream
                        .set_nonblocking(false)
                        .and_then(|()| stream.set_nodelay(true))
                        .and_then(|()| stream.set_read_timeout(Some(timeout)))
                        .map_err(|e| comm_err("configuring a link", &e))?;
                    let (magic, rank, n) = (read_u32(&stream)?, read_u32(&stream)? as usize, read_u32(&stream)?);
                    if magic != HELLO || n as usize != size || rank == 0 || rank >= size {
                        return Err(EngineError::Communicator(format!(
                            "{from} greeted the rendezvous as rank {rank} of {n}, expected a rank of 1..{size} of {size}"
                        )));
                    }
                    if peers[rank - 1].is_some() {
                        return Err(EngineError::Communicator(format!("rank {rank} connected twice")));
                    }
                    stream
                        .set_read_timeout(None)
                        .map_err(|e| comm_err("configuring a link", &e))?;
                    abort.register(&stream)?;
                    peers[rank - 1] = Some(stream);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= until {
                        let missing: Vec<usize> = peers
                            .iter()
                            .enumerate()
                            .filter(|(_, p)| p.is_none())
                            .map(|(i, _)| i + 1)
                            .collect();
                        return Err(EngineError::Communicator(format!(
                            "ranks {missing:?} did not reach the rendezvous at {} within {:.0} s",
                            self.addr,
                            timeout.as_secs_f64()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(comm_err("accepting a rank", &e)),
            }
        }
        Ok(TcpComm {
            rank: 0,
            size,
            links: Links::Hub(peers.into_iter().flatten().collect()),
            abort: abort.clone(),
        })
    }
}

enum Links {
    /// Rank 0: the links to ranks `1..size`, in rank order.
    Hub(Vec<TcpStream>),
    /// Any other rank: its link to rank 0.
    Leaf(TcpStream),
}

/// One rank's handle on a group of ranks in different processes; see the module docs.
pub struct TcpComm {
    rank: usize,
    size: usize,
    links: Links,
    abort: TcpAbort,
}

impl TcpComm {
    /// A group of one rank (no links).
    pub fn single() -> Self {
        TcpComm {
            rank: 0,
            size: 1,
            links: Links::Hub(Vec::new()),
            abort: TcpAbort::new(),
        }
    }

    /// Joins the group whose rank 0 listens at `addr` as rank `rank` of `size`.
    pub fn connect(addr: SocketAddr, rank: usize, size: usize, abort: &TcpAbort, timeout: Duration) -> Result<Self> {
        if rank == 0 || rank >= size {
            return Err(EngineError::Communicator(format!(
                "rank {rank} of {size} cannot join a rendezvous (rank 0 hosts it)"
            )));
        }
        let stream = TcpStream::connect_timeout(&addr, timeout)
            .map_err(|e| comm_err(&format!("rank {rank} connecting to the rendezvous at {addr}"), &e))?;
        stream
            .set_nodelay(true)
            .map_err(|e| comm_err("configuring a link", &e))?;
        let mut hello = Vec::with_capacity(12);
        for w in [HELLO, rank as u32, size as u32] {
            hello.extend_from_slice(&w.to_le_bytes());
        }
        (&stream)
            .write_all(&hello)
            .map_err(|e| comm_err("greeting rank 0", &e))?;
        abort.register(&stream)?;
        Ok(TcpComm {
            rank,
            size,
            links: Links::Leaf(stream),
            abort: abort.clone(),
        })
    }

    /// An I/O failure as the collective's error; an aborted group names the abort instead.
    fn io(&self, what: &str, e: std::io::Error) -> EngineError {
        match self.abort.reason() {
            Some(why) => EngineError::Communicator(format!("group aborted ({why})")),
            None => EngineError::Communicator(format!(
                "rank {}: {what}: {e} (a peer rank's process has gone)",
                self.rank
            )),
        }
    }

    /// Runs one collective: `data` is this rank's contribution; `combine` turns everyone's (rank order) into the
    /// result every rank receives, of `result_len` values.
    fn collective(
        &self,
        op: u8,
        data: &[f32],
        result_len: usize,
        combine: impl FnOnce(&[Vec<f32>]) -> Vec<f32>,
    ) -> Result<Vec<f32>> {
        if let Some(why) = self.abort.reason() {
            return Err(EngineError::Communicator(format!("group aborted ({why})")));
        }
        match &self.links {
            Links::Hub(peers) => {
                let mut slots = Vec::with_capacity(self.size);
                slots.push(data.to_vec());
                let mut mismatch = None;
                for (i, p) in peers.iter().enumerate() {
                    let mut head = [0u8; 9];
                    (&*p)
                        .read_exact(&mut head)
                        .map_err(|e| self.io("reading a contribution", e))?;
                    let (their_op, n) = (head[0], u64::from_le_bytes(head[1..].try_into().unwrap_or_default()));
                    let theirs = read_f32s(p, n as usize).map_err(|e| self.io("reading a contribution", e))?;
                    if (their_op, n as usize) != (op, data.len()) && mismatch.is_none() {
                        mismatch = Some(format!(
                            "rank 0 entered collective {op} of {} values while rank {} entered {their_op} of {n}",
                            data.len(),
                            i + 1
                        ));
                    }
                    slots.push(theirs);
                }
                if let Some(why) = mismatch {
                    for p in peers {
                        let _ = (&*p).write_all(&[MISMATCH]);
                    }
                    self.abort.abort(&why);
                    return Err(EngineError::Communicator(why));
                }
                let out = combine(&slots);
                let mut frame = Vec::with_capacity(1 + 4 * out.len());
                frame.push(OK);
                extend_f32s(&mut frame, &out);
                for p in peers {
                    (&*p).write_all(&frame).map_err(|e| self.io("sending a result", e))?;
                }
                Ok(out)
            }
            Links::Leaf(hub) => {
                let mut frame = Vec::with_capacity(9 + 4 * data.len());
                frame.push(op);
                frame.extend_from_slice(&(data.len() as u64).to_le_bytes());
                extend_f32s(&mut frame, data);
                (&*hub)
                    .write_all(&frame)
                    .map_err(|e| self.io("sending a contribution", e))?;
                let mut status = [0u8; 1];
                (&*hub)
                    .read_exact(&mut status)
                    .map_err(|e| self.io("reading a result", e))?;
                if status[0] != OK {
                    let why = format!("rank {} entered a collective the other ranks did not", self.rank);
                    self.abort.abort(&why);
                    return Err(EngineError::Communicator(why));
                }
                read_f32s(hub, result_len).map_err(|e| self.io("reading a result", e))
            }
        }
    }
}

fn read_u32(s: &TcpStream) -> Result<u32> {
    let mut b = [0u8; 4];
    let mut r = s;
    r.read_exact(&mut b)
        .map_err(|e| comm_err("reading a rank's greeting", &e))?;
    Ok(u32::from_le_bytes(b))
}

fn read_f32s(s: &TcpStream, n: usize) -> std::io::Result<Vec<f32>> {
    let mut bytes = vec![0u8; 4 * n];
    let mut r = s;
    r.read_exact(&mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn extend_f32s(out: &mut Vec<u8>, v: &[f32]) {
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        // A rank that panics while holding its links closes them, so its peers fail instead of waiting forever.
        if std::thread::panicking() {
            self.abort.abort(&format!("rank {} panicked", self.rank));
        }
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let out = self.collective(ALL_REDUCE, buf, buf.len(), |slots| {
            let mut sum = slots[0].clone();
            for slot in &slots[1..] {
                for (b, v) in sum.iter_mut().zip(slot) {
                    *b += v;
                }
            }
            sum
        })?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        if recv.len() != send.len() * self.size {
            return Err(EngineError::Communicator(format!(
                "all_gather: receive buffer holds {} elements, expected {} · {}",
                recv.len(),
                send.len(),
                self.size
            )));
        }
        let out = self.collective(ALL_GATHER, send, recv.len(), |slots| slots.concat())?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.collective(BARRIER, &[], 0, |_| Vec::new()).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::shard::LocalComm;

    /// `size` ranks over loopback, each on its own thread, running `f`.
    fn group<T: Send>(size: usize, f: impl Fn(TcpComm) -> T + Sync) -> Vec<T> {
        let rv = TcpRendezvous::bind(Ipv4Addr::LOCALHOST.into()).expect("bind");
        let addr = rv.addr();
        let t = Duration::from_secs(10);
        std::thread::scope(|s| {
            let f = &f;
            let mut handles = vec![s.spawn(move || f(rv.accept(size, &TcpAbort::new(), t).expect("accept")))];
            for r in 1..size {
                handles
                    .push(s.spawn(move || f(TcpComm::connect(addr, r, size, &TcpAbort::new(), t).expect("connect"))));
            }
            handles.into_iter().map(|h| h.join().expect("rank")).collect()
        })
    }

    #[test]
    fn collectives_match_the_in_process_group_bit_for_bit() {
        for size in [2, 3] {
            let input = |r: usize| {
                (0..7)
                    .map(|i| ((r * 7 + i) as f32 * 0.37).sin() * 1e3)
                    .collect::<Vec<f32>>()
            };
            let tcp = group(size, |c| {
                let mut sum = input(c.rank());
                c.all_reduce_sum(&mut sum).expect("all_reduce");
                let mut gathered = vec![0.0; 3 * size];
                c.all_gather(&input(c.rank())[..3], &mut gathered).expect("all_gather");
                c.barrier().expect("barrier");
                (sum, gathered)
            });
            let local: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
                let hs: Vec<_> = LocalComm::group(size)
                    .into_iter()
                    .map(|c| {
                        s.spawn(move || {
                            let mut sum = input(c.rank());
                            c.all_reduce_sum(&mut sum).expect("all_reduce");
                            let mut gathered = vec![0.0; 3 * size];
                            c.all_gather(&input(c.rank())[..3], &mut gathered).expect("all_gather");
                            (sum, gathered)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("rank")).collect()
            });
            assert_eq!(tcp, local, "size {size}");
        }
    }

    #[test]
    fn a_mismatch_or_a_dead_peer_fails_every_rank_instead_of_hanging() {
        let outcome = group(2, |c| {
            let mut buf = vec![1.0; 3 + c.rank()];
            c.all_reduce_sum(&mut buf).is_err()
        });
        assert_eq!(outcome, vec![true, true]);
        // Rank 1 leaves (its process died: the link closes) while rank 0 waits in a collective.
        let outcome = group(2, |c| {
            if c.rank() == 1 {
                drop(c);
                return true;
            }
            let e = c.barrier().expect_err("peer gone").to_string();
            e.contains("communicator")
        });
        assert_eq!(outcome, vec![true, true]);
        // A stray greeting is refused with the reason.
        let rv = TcpRendezvous::bind(Ipv4Addr::LOCALHOST.into()).expect("bind");
        let mut s = TcpStream::connect(rv.addr()).expect("connect");
        s.write_all(&[0u8; 12]).expect("write");
        let e = rv
            .accept(2, &TcpAbort::new(), Duration::from_secs(5))
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("greeted the rendezvous"), "{e}");
    }
}
