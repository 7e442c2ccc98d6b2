//! Kernel modules compiled for a real architecture without a device, as CI and `rewind compile-kernels` do: NVRTC
//! with ptxas reporting each entry point's registers and spills ([`super::ptxas`]), and a check that every entry point
//! a module declares is in its image (a device would fail to load it).

use rayon::prelude::*;

use super::nvrtc::{compile_with, KernelModule};
use super::ptxas::{self, EntryUse};
use super::{CudaError, Result};

/// One kernel module compiled for a real architecture without a device ([`check_module`]).
#[derive(Clone, Debug)]
pub struct ModuleCheck {
    /// The module (source file) name.
    pub module: &'static str,
    /// The target, `sm_XY`.
    pub target: String,
    /// Every entry point ptxas compiled, with its resource use.
    pub entries: Vec<EntryUse>,
    /// Entry points the module declares (and the device would look up) that the image lacks.
    pub missing: Vec<String>,
    /// NVRTC's wall time.
    pub seconds: f64,
}

/// Compiles `module` for the real architecture `target` (`sm_XY`, `sm_XYa`) with ptxas reporting each entry point's
/// registers and spills, and checks that every entry point the module declares is in the image. Needs only NVRTC:
/// no driver, no GPU. A source the compiler rejects is [`CudaError::Compile`].
pub fn check_module(module: &KernelModule, target: &str) -> Result<ModuleCheck> {
    if !target.starts_with("sm_") {
        return Err(CudaError::Nvrtc {
            context: format!("checking {} for {target}", module.name),
            status: "the target must be a real architecture (sm_XY): ptxas reports only for those".into(),
        });
    }
    let started = std::time::Instant::now();
    let (_, log) = compile_with(module.name, &module.full_source(), target, &["--ptxas-options=-v"])?;
    let entries = ptxas::parse(&log);
    let missing = module
        .function_names()
        .into_iter()
        .filter(|f| !entries.iter().any(|e| &e.name == f))
        .collect();
    Ok(ModuleCheck {
        module: module.name,
        target: target.to_string(),
        entries,
        missing,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// [`check_module`] of every module for every target, in parallel (NVRTC programs are independent), in order:
/// targets outer, modules inner. Each pair's result is its own, so one module's compile error does not hide another's.
pub fn check_modules(modules: &[&KernelModule], targets: &[&str]) -> Vec<(&'static str, String, Result<ModuleCheck>)> {
    let jobs: Vec<(&KernelModule, &str)> = targets
        .iter()
        .flat_map(|&t| modules.iter().map(move |&m| (m, t)))
        .collect();
    jobs.into_par_iter()
        .map(|(module, target)| (module.name, target.to_string(), check_module(module, target)))
        .collect()
}
