//! CPU work of an RPC (tokenizing, detokenizing) run on the blocking pool: on an async worker a long text would stall
//! every other call and connection that worker carries.

use std::sync::Arc;

use tonic::Status;

use super::status::invalid;
use crate::serve::ServeState;

/// `f` over `state` on the blocking pool, in the caller's tracing span.
pub async fn run<T: Send + 'static>(
    state: &Arc<ServeState>,
    f: impl FnOnce(&ServeState) -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    let state = state.clone();
    let span = tracing::Span::current();
    tokio::task::spawn_blocking(move || span.in_scope(|| f(&state)))
        .await
        .unwrap_or_else(|e| Err(Status::internal(format!("a worker failed: {e}"))))
}

/// INVALID_ARGUMENT naming `field` when a text of `len` bytes is longer than the model's context can hold, checked
/// before the text is copied or tokenized.
pub fn check_text(state: &ServeState, field: &str, len: usize) -> Result<(), Status> {
    state.check_text_len(field, len).map_err(|m| invalid(field, m))
}

/// INVALID_ARGUMENT naming `field` when `n` token ids are more than the model's context holds.
pub fn check_id_count(state: &ServeState, field: &str, n: usize) -> Result<(), Status> {
    let context = state.engine.info().max_context;
    if n > context {
        return Err(invalid(
            field,
            format!("{n} token ids exceed the context limit of {context} tokens"),
        ));
    }
    Ok(())
}
