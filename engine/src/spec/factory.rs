//! Building the configured drafter kind's [`DrafterFactory`]: the one place a `--spec` value becomes drafters.

use std::path::Path;
use std::sync::Arc;

use super::config::DrafterKind;
use super::draft_model::{DraftModel, DraftSampling};
use super::mtp::{MtpDrafter, MtpWeights};
use super::ngram::NgramDrafter;
use super::oracle::OracleDrafter;
use super::{DraftRequest, Drafter, DrafterFactory};
use crate::error::{EngineError, Result};

/// What a factory may need of the target.
#[derive(Clone, Copy, Debug)]
pub struct Target<'a> {
    /// The target checkpoint's directory.
    pub dir: &'a Path,
    pub vocab: usize,
    /// Sequences alive at once (a draft model holds one slot each) and the longest context.
    pub slots: usize,
    pub max_context: usize,
    /// The most drafts per step.
    pub window: usize,
    /// The ranks load the MTP layer and draft with it ([`crate::rank::mtp`]): no MTP weights load on the host.
    pub mtp_on_ranks: bool,
}

/// The factory for `kind` (loading a draft model's or the MTP layer's weights now, so a bad checkpoint fails at
/// start-up, not at the first request).
pub fn build(kind: &DrafterKind, target: &Target<'_>) -> Result<Arc<dyn DrafterFactory>> {
    Ok(match kind {
        DrafterKind::Ngram { min_n, max_n } => Arc::new(Ngram {
            kind: kind.clone(),
            drafter: NgramDrafter::new(*min_n, *max_n),
        }),
        DrafterKind::Oracle { p } => Arc::new(Oracle {
            kind: kind.clone(),
            p: *p,
            vocab: target.vocab,
        }),
        DrafterKind::Draft(dir) => draft_factory(kind, dir, target)?,
        DrafterKind::Mtp => mtp_factory(kind, target)?,
    })
}

struct Ngram {
    kind: DrafterKind,
    drafter: NgramDrafter,
}

impl DrafterFactory for Ngram {
    fn kind(&self) -> &DrafterKind {
        &self.kind
    }

    fn drafter(&self, _: &DraftRequest<'_>) -> Result<Box<dyn Drafter>> {
        Ok(Box::new(self.drafter))
    }

    fn on_ranks(&self) -> bool {
        true
    }
}

struct Oracle {
    kind: DrafterKind,
    p: f64,
    vocab: usize,
}

impl DrafterFactory for Oracle {
    fn kind(&self) -> &DrafterKind {
        &self.kind
    }

    fn check(&self, r: &DraftRequest<'_>) -> Result<()> {
        self.reference(r).map(|_| ())
    }

    fn on_ranks(&self) -> bool {
        true
    }

    fn drafter(&self, r: &DraftRequest<'_>) -> Result<Box<dyn Drafter>> {
        let reference = self.reference(r)?;
        Ok(Box::new(OracleDrafter::new(
            reference.to_vec(),
            r.prompt.len(),
            self.p,
            self.vocab,
            r.seed,
        )?))
    }
}

impl Oracle {
    fn reference<'r>(&self, r: &DraftRequest<'r>) -> Result<&'r [u32]> {
        r.reference.ok_or_else(|| {
            EngineError::InvalidInput(
                "the oracle drafter (a benchmarking tool) needs the request's reference continuation: the target's \
                 greedy output for the prompt, computed without speculation (`generate` and `bench` compute it)"
                    .into(),
            )
        })
    }
}

fn draft_factory(kind: &DrafterKind, dir: &Path, target: &Target<'_>) -> Result<Arc<dyn DrafterFactory>> {
    let model = DraftModel::load(
        dir,
        target.vocab,
        target.slots,
        target.max_context,
        target.window,
        Some(target.dir),
    )?;
    Ok(Arc::new(Draft {
        kind: kind.clone(),
        model,
    }))
}

struct Draft {
    kind: DrafterKind,
    model: Arc<DraftModel>,
}

impl DrafterFactory for Draft {
    fn kind(&self) -> &DrafterKind {
        &self.kind
    }

    fn drafter(&self, r: &DraftRequest<'_>) -> Result<Box<dyn Drafter>> {
        // The draft stream must not be the acceptance test's: a draft correlated with the draw that judges it
        // would bias the output.
        let seed = crate::spec::accept::draft_seed(r.seed);
        Ok(Box::new(
            self.model.session(DraftSampling::from_params(r.params, seed))?,
        ))
    }
}

fn mtp_factory(kind: &DrafterKind, target: &Target<'_>) -> Result<Arc<dyn DrafterFactory>> {
    if target.mtp_on_ranks {
        // Checked now, so that a checkpoint without MTP weights fails at start-up with the flag named.
        crate::shard::model::OpenCheckpoint::open(target.dir, true)?;
        return Ok(Arc::new(RankMtp { kind: kind.clone() }));
    }
    Ok(Arc::new(Mtp {
        kind: kind.clone(),
        weights: MtpWeights::load(target.dir)?,
    }))
}

struct Mtp {
    kind: DrafterKind,
    weights: Arc<MtpWeights>,
}

impl DrafterFactory for Mtp {
    fn kind(&self) -> &DrafterKind {
        &self.kind
    }

    fn drafter(&self, _: &DraftRequest<'_>) -> Result<Box<dyn Drafter>> {
        Ok(Box::new(MtpDrafter::new(self.weights.clone())))
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn hidden_width(&self) -> Option<usize> {
        Some(self.weights.config().hidden_size)
    }
}

/// MTP drafting on the ranks: each request's drafter hands on the ranks' proposals.
struct RankMtp {
    kind: DrafterKind,
}

impl DrafterFactory for RankMtp {
    fn kind(&self) -> &DrafterKind {
        &self.kind
    }

    fn drafter(&self, _: &DraftRequest<'_>) -> Result<Box<dyn Drafter>> {
        Ok(Box::new(super::RankMtpDrafter::default()))
    }

    fn mtp_on_ranks(&self) -> bool {
        true
    }
}
