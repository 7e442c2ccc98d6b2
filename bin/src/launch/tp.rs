//! The tensor-parallel size: every GPU chosen unless `--tp` says otherwise (on the CPU, `--tp` rank threads), checked
//! against the model with the plan the loaders use ([`RankPlan`]), so a size that cannot work is refused with the
//! reason before anything loads.

use anyhow::{bail, Result};
use rewind_engine::model::ModelConfig;
use rewind_engine::shard::RankPlan;

/// The TP size for `available` GPUs (`what`: how they were found, e.g. "visible"): `requested` when given (at most
/// `available`), else all of them.
pub fn choose(requested: Option<usize>, available: usize, what: &str) -> Result<usize> {
    match requested {
        Some(0) => bail!("--tp must be at least 1"),
        Some(tp) if tp > available => bail!(
            "--tp {tp} needs {tp} GPUs, but only {available} {} {what}",
            if available == 1 { "is" } else { "are" }
        ),
        Some(tp) => Ok(tp),
        None if available == 0 => bail!("no GPU is {what}; serve on the CPU with --device cpu"),
        None => Ok(available),
    }
}

/// Whether `tp` ranks can split `config`: every rank's plan is made (the vocabulary, every layer's heads, key-value
/// heads, SSM heads and FFN widths split over the ranks); the error names what cannot be split.
pub fn check(config: &ModelConfig, tp: usize) -> Result<()> {
    anyhow::ensure!(tp >= 1, "--tp must be at least 1");
    for rank in 0..tp {
        // The tensors' layout (stored vs tied LM head, fused vs per-expert weights) does not change whether a size
        // splits, so the plan is made for the published layout.
        if let Err(e) = RankPlan::new(config, tp, rank, &|_| false) {
            bail!("--tp {tp} cannot split this model ({}): {e}", config.summary());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::choose;

    #[test]
    fn the_size_defaults_to_every_device_and_never_exceeds_them() {
        assert_eq!(choose(None, 4, "visible").expect("all"), 4);
        assert_eq!(choose(Some(2), 4, "visible").expect("two"), 2);
        let e = choose(Some(3), 2, "listed in --gpus")
            .expect_err("too many")
            .to_string();
        assert!(
            e.contains("--tp 3 needs 3 GPUs, but only 2 are listed in --gpus"),
            "{e}"
        );
        assert!(choose(Some(0), 2, "visible").is_err());
        assert!(choose(None, 0, "visible").is_err());
    }
}
