//! The gRPC API (`rewind.v1.Rewind`, `proto/rewind/v1/rewind.proto`): sessions that keep the model's state between
//! turns and fork it, stateless streaming completion, tokenization, health and statistics, over the one engine of a
//! [`ServeState`]. [`service`] is the server with its API key check; [`client::connect`] the matching client.
//!
//! Each RPC runs in a `grpc` tracing span named after it; a streaming call's span covers its chunks too.

mod auth;
mod blocking;
mod chat;
pub mod client;
mod info;
pub(crate) mod json;
mod params;
mod sessions;
mod status;
mod stream;
mod structured;

use std::sync::Arc;

use rewind_actors::GenerateRequest;
use rewind_engine::rank::MAX_TOP;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};
use tracing::Instrument;

pub use auth::Auth;
pub use stream::ChunkStream;

use crate::serve::http::errors::echo;
use crate::serve::ServeState;

/// The messages, server and client generated from `rewind.proto`.
pub mod pb {
    tonic::include_proto!("rewind.v1");
}

/// The gRPC server type: the API behind its API key check.
pub type Service = InterceptedService<pb::rewind_server::RewindServer<RewindService>, Auth>;

/// The API over `state`'s engine, with the API key check (a no-op when `state.api_keys` has none). Add it to a
/// `tonic::transport::Server`.
pub fn service(state: Arc<ServeState>) -> Service {
    // Messages past --max-request-bytes are refused before they are decoded.
    let server = pb::rewind_server::RewindServer::new(RewindService { state: state.clone() })
        .max_decoding_message_size(state.limits.max_request_bytes);
    InterceptedService::new(server, Auth::new(state))
}

/// The implementation of `rewind.v1.Rewind`.
pub struct RewindService {
    state: Arc<ServeState>,
}

/// A tracing span for one RPC.
fn span(rpc: &'static str) -> tracing::Span {
    tracing::info_span!("grpc", rpc)
}

/// The top entries per generated token a request asks for (`logprobs` with `top_logprobs` alternatives), checked:
/// at most [`MAX_TOP`], and `top_logprobs` only with `logprobs`.
fn logprob_options(logprobs: bool, top: Option<u32>) -> Result<Option<usize>, Status> {
    if let Some(k) = top.filter(|&k| k as usize > MAX_TOP) {
        return Err(Status::invalid_argument(format!(
            "top_logprobs must be between 0 and {MAX_TOP}, got {k}"
        )));
    }
    if top.is_some_and(|k| k > 0) && !logprobs {
        return Err(Status::invalid_argument("top_logprobs requires logprobs to be set"));
    }
    Ok(logprobs.then(|| top.unwrap_or(0) as usize))
}

#[tonic::async_trait]
impl pb::rewind_server::Rewind for RewindService {
    async fn create_session(
        &self,
        request: Request<pb::CreateSessionRequest>,
    ) -> Result<Response<pb::SessionInfo>, Status> {
        let owner = auth::owner(&request)?;
        let r = request.into_inner();
        sessions::create(&self.state, owner, &r)
            .instrument(span("CreateSession"))
            .await
            .map(Response::new)
    }

    type GenerateStream = ChunkStream;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<ChunkStream>, Status> {
        let owner = auth::owner(&request)?;
        let r = request.into_inner();
        let span = tracing::info_span!("grpc", rpc = "Generate", session = %echo(&r.session_id));
        sessions::generate(&self.state, owner, r, span.clone())
            .instrument(span)
            .await
            .map(Response::new)
    }

    async fn fork_session(
        &self,
        request: Request<pb::ForkSessionRequest>,
    ) -> Result<Response<pb::SessionInfo>, Status> {
        let owner = auth::owner(&request)?;
        let id = request.into_inner().session_id;
        let span = tracing::info_span!("grpc", rpc = "ForkSession", session = %id);
        sessions::fork(&self.state, owner, &id)
            .instrument(span)
            .await
            .map(Response::new)
    }

    async fn close_session(
        &self,
        request: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let owner = auth::owner(&request)?;
        let id = request.into_inner().session_id;
        let span = tracing::info_span!("grpc", rpc = "CloseSession", session = %id);
        sessions::close(&self.state, owner, &id).instrument(span).await?;
        Ok(Response::new(pb::CloseSessionResponse {}))
    }

    async fn get_session(&self, request: Request<pb::GetSessionRequest>) -> Result<Response<pb::SessionInfo>, Status> {
        let owner = auth::owner(&request)?;
        let id = request.into_inner().session_id;
        let span = tracing::info_span!("grpc", rpc = "GetSession", session = %id);
        sessions::get(&self.state, owner, &id)
            .instrument(span)
            .await
            .map(Response::new)
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let sessions = sessions::list(&self.state, auth::owner(&request)?)
            .instrument(span("ListSessions"))
            .await?;
        Ok(Response::new(pb::ListSessionsResponse { sessions }))
    }

    type CompleteStream = ChunkStream;

    async fn complete(&self, request: Request<pb::CompleteRequest>) -> Result<Response<ChunkStream>, Status> {
        let span = span("Complete");
        let r = request.into_inner();
        complete(&self.state, r, span.clone())
            .instrument(span)
            .await
            .map(Response::new)
    }

    async fn tokenize(&self, request: Request<pb::TokenizeRequest>) -> Result<Response<pb::TokenizeResponse>, Status> {
        let r = request.into_inner();
        blocking::check_text(&self.state, "text", r.text.len())?;
        blocking::run(&self.state, move |s| info::tokenize(s, &r))
            .instrument(span("Tokenize"))
            .await
            .map(Response::new)
    }

    async fn detokenize(
        &self,
        request: Request<pb::DetokenizeRequest>,
    ) -> Result<Response<pb::DetokenizeResponse>, Status> {
        let r = request.into_inner();
        blocking::run(&self.state, move |s| info::detokenize(s, &r))
            .instrument(span("Detokenize"))
            .await
            .map(Response::new)
    }

    async fn get_model_info(
        &self,
        _request: Request<pb::GetModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfo>, Status> {
        let _g = span("GetModelInfo").entered();
        Ok(Response::new(chat::model_info(&self.state)))
    }

    async fn render_chat(
        &self,
        request: Request<pb::RenderChatRequest>,
    ) -> Result<Response<pb::RenderChatResponse>, Status> {
        let r = request.into_inner();
        blocking::run(&self.state, move |s| chat::render_chat(s, &r))
            .instrument(span("RenderChat"))
            .await
            .map(Response::new)
    }

    async fn health(&self, _request: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(
            info::health(&self.state).instrument(span("Health")).await,
        ))
    }

    async fn stats(&self, _request: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        Ok(Response::new(info::stats(&self.state).instrument(span("Stats")).await))
    }
}

/// Complete: a stateless generation from the whole prompt.
async fn complete(state: &Arc<ServeState>, r: pb::CompleteRequest, span: tracing::Span) -> Result<ChunkStream, Status> {
    if state.draining() {
        return Err(status::draining());
    }
    let logprobs = logprob_options(r.logprobs, r.top_logprobs)?;
    let prompt_logprobs = match r.prompt_logprobs {
        Some(k) if k as usize > MAX_TOP => {
            return Err(Status::invalid_argument(format!(
                "prompt_logprobs must be between 0 and {MAX_TOP}, got {k}"
            )))
        }
        k => k.map(|k| k as usize),
    };
    let n = r.n.map_or(1, |n| n as usize);
    // `max_tokens: 0` with prompt_logprobs scores the prompt: the engine runs it and generates nothing.
    let scoring = prompt_logprobs.is_some() && r.sampling.as_ref().is_some_and(|s| s.max_tokens == Some(0));
    let sampling = r.sampling.map(|mut s| {
        if scoring {
            s.max_tokens = None;
        }
        s
    });
    let mut params = params::merge(state, &params::base(state), sampling.as_ref())?;
    structured::constrain(state, sampling.as_ref(), &mut params).await?;
    let prompt = params::input_ids(state, r.input, true).await?;
    params::default_max_tokens(state, &mut params, prompt.len());
    if scoring {
        params.max_tokens = Some(0);
    }
    let mut request = GenerateRequest::new(prompt, params);
    request.speculate = r.speculate.unwrap_or(true);
    request.n = n;
    request.logprobs = logprobs;
    request.prompt_logprobs = prompt_logprobs;
    let events = state.engine.submit(request).map_err(|e| status::actors(&e))?;
    stream::respond(events, state.cut_off_watch(), span).await
}
