//! `--spec` and friends: the speculation settings from the flags (checked before anything loads), the drafters'
//! factory once the target's sizes are known, and the report `generate` prints.

use std::path::Path;

use anyhow::Result;
use rewind_actors::EngineSpec;
use rewind_engine::spec::factory::{build, Target};
use rewind_engine::spec::{DrafterKind, SpecConfig, StepProfile};

use crate::cli::{DecodeArgs, SpecArgs};

/// The speculation settings, or `None` for `--spec none`; every bad value is an error naming its flag.
pub fn config(args: &SpecArgs, decode: &DecodeArgs) -> Result<Option<SpecConfig>> {
    let Some(mut drafter) = DrafterKind::parse_flag(&args.spec)? else {
        anyhow::ensure!(
            args.spec_profile.is_none(),
            "--spec-profile needs speculation: --spec DRAFTER --spec-policy adaptive"
        );
        return Ok(None);
    };
    if let DrafterKind::Ngram { min_n, max_n } = &mut drafter {
        (*min_n, *max_n) = (args.ngram_min, args.ngram_max);
    }
    let profile = match &args.spec_profile {
        Some(path) => Some(StepProfile::load(path)?),
        None => None,
    };
    let config = SpecConfig {
        drafter,
        window: args.spec_window,
        policy: args.spec_policy.parse()?,
        profile,
    };
    config.validate(decode.buffer_len)?;
    Ok(Some(config))
}

/// The engine's speculation for the target in `dir` (a draft model or the host's MTP weights load here; with
/// `mtp_on_ranks` the ranks loaded the MTP layer and draft with it).
pub fn engine_spec(
    config: &SpecConfig,
    dir: &Path,
    vocab: usize,
    slots: usize,
    max_context: usize,
    mtp_on_ranks: bool,
) -> Result<EngineSpec> {
    let factory = build(
        &config.drafter,
        &Target {
            dir,
            vocab,
            slots,
            max_context,
            window: config.window,
            mtp_on_ranks,
        },
    )?;
    Ok(EngineSpec {
        config: config.clone(),
        factory,
    })
}
