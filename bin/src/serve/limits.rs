//! The bounds a server puts on its clients, from the serving flags: on connections ([`ConnLimits`], enforced by
//! [`super::conn`]) and on each request ([`RequestLimits`], read by both APIs' handlers through
//! [`super::ServeState`]). Without them a few slow or idle clients hold every socket, and one huge body stalls the
//! async workers that carry everyone else's requests.

use std::time::Duration;

use anyhow::Result;

use crate::cli::ListenArgs;

/// `--max-connections`: per server. Well under the usual 1024-descriptor soft limit per server is not possible for
/// both, so a host serving many clients raises `ulimit -n` along with it.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// `--max-request-bytes`: a 32k-token prompt as token ids is about 200 kB, its text at most a few MB; 16 MiB leaves
/// room for long contexts while a parsed body (several times its size as JSON values) stays bounded.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 16 << 20;
/// `--header-timeout`: hyper's and nginx's order of magnitude.
pub const DEFAULT_HEADER_TIMEOUT_SECS: f64 = 30.0;
/// `--body-timeout`: a 16 MiB body over a slow link still arrives.
pub const DEFAULT_BODY_TIMEOUT_SECS: f64 = 60.0;
/// `--keep-alive-timeout`: nginx's default, above the 60 s idle timeout of common load balancers (a server that
/// closes first races the balancer's next request on that connection).
pub const DEFAULT_KEEP_ALIVE_TIMEOUT_SECS: f64 = 75.0;

/// Bounds on connections, per server.
#[derive(Clone, Debug, PartialEq)]
pub struct ConnLimits {
    /// Connections each server keeps open at once.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers once it starts (HTTP), or the HTTP/2 preface after
    /// connecting (gRPC).
    pub header_timeout: Duration,
    /// How long an HTTP connection may sit idle between requests.
    pub keep_alive_timeout: Duration,
}

/// Bounds on one request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestLimits {
    /// The largest HTTP body or gRPC message.
    pub max_request_bytes: usize,
    /// How long an HTTP body may take to arrive in full.
    pub body_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: Duration::from_secs_f64(DEFAULT_HEADER_TIMEOUT_SECS),
            keep_alive_timeout: Duration::from_secs_f64(DEFAULT_KEEP_ALIVE_TIMEOUT_SECS),
        }
    }
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            body_timeout: Duration::from_secs_f64(DEFAULT_BODY_TIMEOUT_SECS),
        }
    }
}

/// Both kinds of limits of the serving flags, checked (a zero or negative timeout is an error: it would close every
/// connection at once).
pub fn from_args(a: &ListenArgs) -> Result<(ConnLimits, RequestLimits)> {
    let seconds = |v: f64, flag: &str| crate::cli::seconds(v, flag, false);
    let max_connections = usize::try_from(a.max_connections)?;
    let max_request_bytes = usize::try_from(a.max_request_bytes)?;
    Ok((
        ConnLimits {
            max_connections,
            header_timeout: seconds(a.header_timeout, "--header-timeout")?,
            keep_alive_timeout: seconds(a.keep_alive_timeout, "--keep-alive-timeout")?,
        },
        RequestLimits {
            max_request_bytes,
            body_timeout: seconds(a.body_timeout, "--body-timeout")?,
        },
    ))
}

/// `n` bytes in words for an error message: `16 MiB`, `1500 bytes`.
pub fn bytes(n: usize) -> String {
    const MIB: usize = 1 << 20;
    const KIB: usize = 1 << 10;
    if n >= MIB && n.is_multiple_of(MIB) {
        format!("{} MiB", n / MIB)
    } else if n >= KIB && n.is_multiple_of(KIB) {
        format!("{} KiB", n / KIB)
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_in_their_unit() {
        assert_eq!(bytes(16 << 20), "16 MiB");
        assert_eq!(bytes(4096), "4 KiB");
        assert_eq!(bytes(1500), "1500 bytes");
    }
}
