//! A connected API client (what `rewind client` and `rewind chat` use): the generated client over a channel that
//! sends the API key, when there is one, as `authorization: Bearer <key>` on every call.

use anyhow::{Context, Result};
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use super::pb::rewind_client::RewindClient;

/// Adds the API key to every call.
#[derive(Clone)]
pub struct BearerAuth {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl Interceptor for BearerAuth {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            request.metadata_mut().insert("authorization", h.clone());
        }
        Ok(request)
    }
}

/// The client type [`connect`] returns.
pub type Client = RewindClient<InterceptedService<Channel, BearerAuth>>;

/// Connects to the server at `addr` (`http://host:port`; a bare `host:port` gets `http://`).
pub async fn connect(addr: &str, api_key: Option<&str>) -> Result<Client> {
    let url = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let header = api_key
        .map(|k| {
            MetadataValue::try_from(format!("Bearer {k}"))
                .context("the API key must be printable ASCII (it is sent as gRPC metadata)")
        })
        .transpose()?;
    let channel = Endpoint::from_shared(url.clone())
        .with_context(|| format!("`{addr}` is not a server address (expected http://HOST:PORT)"))?
        .connect()
        .await
        .with_context(|| format!("connecting to {url}"))?;
    Ok(RewindClient::with_interceptor(channel, BearerAuth { header }))
}
