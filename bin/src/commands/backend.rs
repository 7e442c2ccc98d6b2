//! The one place the commands choose a backend: the model in `dir` loaded as a [`RankGroup`] on the CPU (`--tp`
//! rank threads) or on GPUs, which every command then drives through the same rank interface.

use std::path::Path;

use anyhow::Result;
use rewind_engine::decode::{DecoderConfig, FormChoice};
use rewind_engine::model::ModelConfig;
use rewind_engine::rank::{cpu_group, CpuOptions, RankGroup};

use crate::cli::{DecodeArgs, Device, DeviceArgs};

/// What a command needs of the pools.
#[derive(Clone, Copy, Debug)]
pub struct Needs {
    /// Sequences alive at once.
    pub slots: usize,
    /// The longest context any of them reaches.
    pub context: usize,
}

/// A model loaded on its device, with the decode form its sequences use.
pub struct Loaded {
    pub group: RankGroup,
    pub config: ModelConfig,
    pub form: FormChoice,
    /// The device, in words (for reports).
    pub device: String,
}

/// Loads the model in `dir` where `device` says, sized for `needs`, with `decode`'s form and ring length (the CPU
/// default form is `auto`, the GPU's `recurrent`, the only one it runs yet).
pub fn open(dir: &Path, device: &DeviceArgs, decode: Option<&DecodeArgs>, needs: Needs) -> Result<Loaded> {
    // The flags are checked before anything is read.
    let which = device.device()?;
    let config = ModelConfig::from_dir(dir)?;
    let context = needs.context.clamp(1, config.max_position_embeddings);
    match which {
        Device::Cpu => {
            let mut dc = DecoderConfig::new(needs.slots.max(1), context);
            if let Some(d) = decode {
                dc.buffer_len = d.buffer_len;
            }
            let group = cpu_group(
                dir,
                &CpuOptions {
                    tp: device.tp,
                    decoder: dc,
                },
            )?;
            Ok(Loaded {
                group,
                config,
                form: decode.and_then(|d| d.form).unwrap_or(FormChoice::Auto),
                device: format!("cpu ({} threads, tp {})", rayon::current_num_threads(), device.tp),
            })
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(devices) => {
            if let Some(d) = decode {
                d.check_gpu()?;
            }
            let mut dargs = device.clone();
            if dargs.max_model_len.is_none() {
                dargs.max_model_len = Some(context);
            }
            dargs.max_seqs = dargs.max_seqs.max(needs.slots);
            let (group, report) = super::gpu::load(dir, &dargs, devices)?;
            Ok(Loaded {
                group,
                config,
                form: FormChoice::Recurrent,
                device: report.devices.join(", "),
            })
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(super::no_cuda()),
    }
}
