//! Structured outputs over gRPC: `Sampling.constraint` compiled on the blocking pool into the request's (or the
//! session's) sampling parameters; a constraint that does not compile is INVALID_ARGUMENT naming its field.

use std::sync::Arc;

use rewind_engine::grammar::ConstraintSpec;
use rewind_engine::sample::SamplingParams;
use tonic::Status;

use super::pb;
use super::pb::sampling::Constraint;
use super::status::{engine, invalid};
use crate::serve::ServeState;

/// The field of `c` (as errors name it) and what it asks for.
fn spec(c: &Constraint) -> Result<(&'static str, ConstraintSpec), Status> {
    Ok(match c {
        Constraint::JsonSchema(text) => {
            let schema = serde_json::from_str(text).map_err(|e| invalid("json_schema", format!("is not JSON: {e}")))?;
            ("json_schema", ConstraintSpec::JsonSchema(schema))
        }
        Constraint::JsonObject(true) => ("json_object", ConstraintSpec::JsonObject),
        Constraint::JsonObject(false) => return Err(invalid("json_object", "must be true when set")),
        Constraint::Regex(rx) => ("regex", ConstraintSpec::Regex(rx.clone())),
        Constraint::Choice(pb::Choices { choices }) => ("choice", ConstraintSpec::Choice(choices.clone())),
        Constraint::Grammar(lark) => ("grammar", ConstraintSpec::Lark(lark.clone())),
    })
}

/// Compiles `sampling`'s constraint, when it has one, into `p` (then checked again as a whole: a constraint takes
/// neither `ignore_eos` nor `min_tokens`).
pub async fn constrain(
    state: &Arc<ServeState>,
    sampling: Option<&pb::Sampling>,
    p: &mut SamplingParams,
) -> Result<(), Status> {
    let Some(c) = sampling.and_then(|s| s.constraint.as_ref()) else {
        return Ok(());
    };
    let (field, spec) = spec(c)?;
    let compiled = super::blocking::run(state, move |s| {
        s.compile_constraint(spec).map_err(|m| invalid(field, m))
    })
    .await?;
    p.constraint = Some(compiled);
    p.validate(state.engine.info().vocab).map_err(|e| engine(&e))
}
