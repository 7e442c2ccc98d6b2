//! `rewind plan`: what a model needs per tensor-parallel rank on a GPU (weights, SSM state and KV bytes, how many
//! sequences fit) and a projected decode step and prefill rate, per decode form, for GPUs we cannot run here. The
//! projection is a roofline over the bytes and FLOPs the engine's own layout implies, calibrated against measured
//! `rewind bench --device cuda` runs. See `docs/gpu-profiles.md` for the model and its sources.
//!
//! - [`profiles`]: GPU profiles (built-in H100, H200, B200, B300 and `--gpu-spec FILE`).
//! - [`rank`]: one rank's share of a model, from the engine's shard plan.
//! - [`projection`]: memory per form, decode step terms, prefill rate.
//! - [`calibration`]: measured runs, the same projection for each, and the ratios `rewind plan` prints.

pub mod calibration;
pub mod profiles;
pub mod projection;
pub mod rank;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

use serde::{Serialize, Serializer};

use crate::state::DecodeForm;

pub use profiles::GpuProfile;
pub use projection::{project, Plan, PlanInput};
pub use rank::RankModel;

/// What can be wrong with a plan's inputs. Each message names the input.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// `--gpu NAME` is not a built-in profile.
    #[error("unknown --gpu `{name}`; built-in profiles: {known} (or give --gpu-spec FILE)")]
    UnknownGpu { name: String, known: String },
    /// A profile file could not be read or parsed (a missing field is named by the parser).
    #[error("GPU profile {path}: {message}")]
    ProfileFile { path: PathBuf, message: String },
    /// Profile JSON that did not parse.
    #[error("GPU profile: {0}")]
    ProfileJson(String),
    /// A profile field out of range.
    #[error("GPU profile `{profile}`: field `{field}` {message}")]
    ProfileField {
        profile: String,
        field: &'static str,
        message: String,
    },
    /// The engine's shard plan refuses this tensor-parallel size.
    #[error("--tp {tp} is not a split this engine can run: {source}")]
    Sharding {
        tp: usize,
        #[source]
        source: crate::EngineError,
    },
    /// Not even one sequence fits next to the weights.
    #[error("{0}")]
    DoesNotFit(String),
    /// Any other input out of range (named in the message).
    #[error("{0}")]
    Invalid(String),
}

impl From<PlanError> for crate::EngineError {
    fn from(e: PlanError) -> Self {
        crate::EngineError::InvalidInput(e.to_string())
    }
}

/// A row the projection prices: slots decoded in a [`DecodeForm`], verifying `T` drafts a step or not. Only the rows
/// of [`FormRow::ALL`] exist (the fields are private): speculation is priced for replay alone, the form rewind
/// verifies drafts in, as `replay+spec`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FormRow {
    form: DecodeForm,
    verifies: bool,
}

impl FormRow {
    /// Full state read and written every token.
    pub const RECURRENT: FormRow = FormRow::decoding(DecodeForm::Recurrent);
    /// Checkpoint + input ring, no speculation.
    pub const REPLAY: FormRow = FormRow::decoding(DecodeForm::Replay);
    /// No state below the kv-only threshold, replay past it.
    pub const KV_ONLY: FormRow = FormRow::decoding(DecodeForm::KvOnly);
    /// Replay verifying `T` drafts per step.
    pub const REPLAY_SPEC: FormRow = FormRow {
        form: DecodeForm::Replay,
        verifies: true,
    };

    /// Every row, in table order.
    pub const ALL: [FormRow; 4] = [
        FormRow::RECURRENT,
        FormRow::REPLAY,
        FormRow::KV_ONLY,
        FormRow::REPLAY_SPEC,
    ];

    /// Plain decoding in `form`, one token a step.
    pub const fn decoding(form: DecodeForm) -> Self {
        FormRow { form, verifies: false }
    }

    /// The decode form the row's slots run in.
    pub fn form(self) -> DecodeForm {
        self.form
    }

    /// Whether the row's steps verify drafts.
    pub fn verifies(self) -> bool {
        self.verifies
    }

    /// The speculative window a slot of this row holds room for when the plan's window is `spec_window`.
    pub fn spec_window(self, spec_window: usize) -> usize {
        if self.verifies {
            spec_window
        } else {
            0
        }
    }

    /// The name printed in tables and taken by `--forms`.
    pub fn name(self) -> &'static str {
        if self.verifies {
            "replay+spec"
        } else {
            self.form.name()
        }
    }

    /// Parses a `--forms` entry.
    pub fn parse(text: &str) -> Result<Self, PlanError> {
        FormRow::ALL
            .into_iter()
            .find(|f| f.name() == text.trim())
            .ok_or_else(|| {
                PlanError::Invalid(format!(
                    "unknown decode form `{text}`; expected recurrent, replay, kv-only or replay+spec"
                ))
            })
    }
}

// JSON names are the tables' in kebab case (`replay-spec`), as `rewind plan --json` has always written them.
impl Serialize for FormRow {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(if self.verifies { "replay-spec" } else { self.form.name() })
    }
}
