//! Run-time compilation of the `.cu` kernel sources with NVRTC, with an on-disk cache.
//!
//! Each module is `kernels/common.cuh` followed by one `.cu` file, compiled for the device's own `sm_XY` into a CUBIN
//! (or, when this NVRTC does not know the device, into PTX for the newest `compute_XY` it knows, which the driver
//! finishes). Images are cached under `$REWIND_CACHE/nvrtc/` (default `$XDG_CACHE_HOME/rewind/nvrtc/`, else
//! `~/.cache/rewind/nvrtc/`), keyed by a hash of the source, target, options and NVRTC version, so an edited kernel or a
//! new compiler never reuses a stale image. The cache is an optimisation only: when it cannot be read or written the
//! module is compiled.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys, Ptx};

use super::device::probe_nvrtc;
use super::{CudaError, Result};

/// Text prepended to every module: bf16 conversions, activations, reductions.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// A kernel source file and the entry points it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelModule {
    /// Module name (the file's stem).
    pub name: &'static str,
    /// The `.cu` source.
    pub source: &'static str,
    /// A header shared with sibling modules, placed between the common header and the source: its name and text.
    pub prelude: Option<(&'static str, &'static str)>,
    /// Entry points: with `typed`, each exists as `<name>_f32` and `<name>_bf16`.
    pub kernels: &'static [&'static str],
    /// Whether the entry points come in the two storage types.
    pub typed: bool,
}

impl KernelModule {
    /// The full names of the module's entry points.
    pub fn function_names(&self) -> Vec<String> {
        if self.typed {
            self.kernels
                .iter()
                .flat_map(|k| [format!("{k}_f32"), format!("{k}_bf16")])
                .collect()
        } else {
            self.kernels.iter().map(|k| k.to_string()).collect()
        }
    }

    /// The text NVRTC compiles: the common header, then the file, with line numbers in the log counted from the file.
    pub fn full_source(&self) -> String {
        let prelude = self
            .prelude
            .map(|(name, text)| format!("#line 1 \"{name}\"\n{text}\n"))
            .unwrap_or_default();
        format!("{COMMON}\n{prelude}#line 1 \"{}.cu\"\n{}", self.name, self.source)
    }
}

macro_rules! module {
    ($name:literal, typed: $typed:expr, [$($k:literal),* $(,)?]) => {
        KernelModule {
            name: $name,
            source: include_str!(concat!("kernels/", $name, ".cu")),
            prelude: None,
            kernels: &[$($k),*],
            typed: $typed,
        }
    };
    ($name:literal, typed: $typed:expr, prelude: $prelude:literal, [$($k:literal),* $(,)?]) => {
        KernelModule {
            name: $name,
            source: include_str!(concat!("kernels/", $name, ".cu")),
            prelude: Some(($prelude, include_str!(concat!("kernels/", $prelude)))),
            kernels: &[$($k),*],
            typed: $typed,
        }
    };
}

/// Every kernel module; [`super::CudaDevice::open`] loads them all.
pub const MODULES: &[KernelModule] = &[
    module!("cast", typed: false, ["cast_f32_bf16", "cast_bf16_f32"]),
    module!("act", typed: true, ["act", "act_vec", "swiglu", "swiglu_vec"]),
    module!("norm", typed: true, ["rms_norm", "gated_rms_norm", "l2_norm"]),
    module!("conv", typed: true, ["conv1d", "conv1d_vec"]),
    module!("rope", typed: true, ["rope"]),
    module!("embedding", typed: true, ["embedding"]),
    module!("mamba2", typed: true, ["mamba2_step"]),
    module!("gdn", typed: true, ["gdn_step"]),
    module!(
        "replay_mamba2",
        typed: true,
        prelude: "replay_common.cuh",
        [
            "mamba2_replay_nc1",
            "mamba2_replay_nc2",
            "mamba2_replay_nc4",
            "mamba2_replay_nc8"
        ]
    ),
    module!(
        "replay_gdn",
        typed: true,
        prelude: "replay_common.cuh",
        [
            "gdn_replay_nc1_sb1",
            "gdn_replay_nc2_sb1",
            "gdn_replay_nc4_sb1",
            "gdn_replay_nc8_sb1",
            "gdn_replay_nc1_sb4",
            "gdn_replay_nc2_sb4",
            "gdn_replay_nc4_sb4",
            "gdn_replay_nc8_sb4"
        ]
    ),
    module!(
        "spec_baseline",
        typed: false,
        [
            "spec_mamba2_verify_v4_f32",
            "spec_mamba2_verify_v4_bf16",
            "spec_mamba2_verify_v1_f32",
            "spec_mamba2_verify_v1_bf16",
            "spec_gdn_verify_v4_f32",
            "spec_gdn_verify_v4_bf16",
            "spec_gdn_verify_v1_f32",
            "spec_gdn_verify_v1_bf16",
            "spec_commit",
        ]
    ),
    module!("attention", typed: true, ["kv_write", "attn_paged"]),
    module!(
        "attention_flash",
        typed: false,
        prelude: "mma_common.cuh",
        [
            "attn_flash_decode_d64",
            "attn_flash_decode_d128",
            "attn_flash_decode_d256",
            "attn_flash_prefill_d64",
            "attn_flash_prefill_d128",
            "attn_flash_prefill_d256",
            "attn_combine_bf16",
        ]
    ),
    module!("ssd", typed: true, ["ssd_chunk_state", "ssd_state_scan", "ssd_chunk_out"]),
    module!(
        "ssd_tc",
        typed: false,
        prelude: "mma_common.cuh",
        ["ssd_tc_state_n64", "ssd_tc_out_n64", "ssd_tc_state_n128", "ssd_tc_out_n128"]
    ),
    module!("gdn_chunk", typed: true, ["gdn_chunk_prep", "gdn_chunk_scan"]),
    module!("gdn_tc", typed: false, prelude: "mma_common.cuh", ["gdn_tc_prep", "gdn_tc_scan"]),
    module!("moe_route", typed: false, ["route_softmax", "route_sigmoid_grouped", "moe_align"]),
    module!("moe", typed: true, ["moe_gemm", "moe_combine"]),
    module!("moe_tc", typed: false, prelude: "mma_common.cuh", ["moe_gemm_tc_m16", "moe_gemm_tc_m64"]),
    module!(
        "glue",
        typed: true,
        [
            "gather_cols",
            "copy_cols",
            "copy_cols_vec",
            "copy_rows",
            "add_rms_norm",
            "dt_softplus",
            "gdn_gates",
            "sigmoid_mul",
            "swiglu_split",
            "add_bias",
            "embed_rows_f32",
            "moe_finish",
            "gated_sq_sums",
            "gated_norm_apply",
        ]
    ),
    module!("sample", typed: false, ["argmax_rows", "repetition_penalty", "logit_bias", "token_mask", "sample_rows", "chain_pick"]),
    module!("lm_head", typed: false, ["head_summary_parts", "head_summary_merge", "spec_accept", "head_topk_parts", "head_topk_merge"]),
    module!("spec_chain", typed: false, ["chain_advance", "chain_draft", "chain_spec"]),
    module!("gemv", typed: true, ["gemv"]),
    module!("gemv_quant", typed: true, ["gemv_fp8_block", "gemv_fp8_scaled", "gemv_nvfp4"]),
    module!("probe", typed: false, ["read_probe"]),
];

/// Compiler options besides the target.
const OPTIONS: &[&str] = &["--std=c++17"];

/// [`OPTIONS`], plus `-lineinfo` under `REWIND_NVRTC_LINEINFO=1`: source lines in the images, so that a profiler's
/// per-instruction stall samples map back to the kernels' code (`bench/gpu/ncu_source.sh`). Part of the cache key,
/// so such images never stand in for the usual ones.
fn options() -> Vec<&'static str> {
    options_for(std::env::var("REWIND_NVRTC_LINEINFO").is_ok_and(|v| v == "1"))
}

fn options_for(lineinfo: bool) -> Vec<&'static str> {
    let mut o = OPTIONS.to_vec();
    if lineinfo {
        o.push("-lineinfo");
    }
    o
}

/// What NVRTC produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for one architecture.
    Cubin,
    /// PTX, finished by the driver at load time.
    Ptx,
}

/// A compiled module image.
#[derive(Clone, Debug)]
pub struct Image {
    /// The target (`sm_90`, `compute_90`).
    pub arch: String,
    /// CUBIN or PTX.
    pub kind: ImageKind,
    /// The image (PTX without a trailing NUL).
    pub bytes: Vec<u8>,
    /// Whether it came from the on-disk cache.
    pub cached: bool,
}

impl Image {
    /// The form the driver's module loader takes.
    pub fn to_ptx(&self) -> Ptx {
        match self.kind {
            ImageKind::Cubin => Ptx::from_binary(self.bytes.clone()),
            ImageKind::Ptx => Ptx::from_src(String::from_utf8_lossy(&self.bytes).into_owned()),
        }
    }
}

fn status(r: nvrtc_sys::nvrtcResult) -> String {
    format!("{r:?}")
}

fn nvrtc_err(context: &str) -> impl FnOnce(nvrtc_result::NvrtcError) -> CudaError + '_ {
    move |e| CudaError::Nvrtc {
        context: context.to_string(),
        status: status(e.0),
    }
}

/// NVRTC's version `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    probe_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(nvrtc_err("nvrtcVersion"))?;
    Ok((major, minor))
}

/// The real architectures this NVRTC can build for, as `10·major + minor`.
pub fn supported_archs() -> Result<Vec<i32>> {
    probe_nvrtc()?;
    let mut n = 0;
    // SAFETY: out-parameter, then a buffer of the size NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(nvrtc_err("nvrtcGetNumSupportedArchs"))?;
    let mut archs = vec![0i32; n.max(0) as usize];
    unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
        .result()
        .map_err(nvrtc_err("nvrtcGetSupportedArchs"))?;
    Ok(archs)
}

/// Chooses the target for a device of compute capability `arch`: its own `sm_XY` when NVRTC knows it, else PTX for the
/// newest older architecture NVRTC knows.
pub fn target_for(arch: (u32, u32), supported: &[i32]) -> Result<String> {
    let want = (arch.0 * 10 + arch.1) as i32;
    if supported.contains(&want) {
        return Ok(format!("sm_{want}"));
    }
    supported
        .iter()
        .copied()
        .filter(|&a| a < want)
        .max()
        .map(|a| format!("compute_{a}"))
        .ok_or_else(|| {
            CudaError::Unavailable(format!(
                "this NVRTC cannot build for compute capability {}.{} (it supports {supported:?})",
                arch.0, arch.1
            ))
        })
}

/// FNV-1a (64-bit) over the parts, each terminated by a zero byte: stable across builds and platforms.
pub fn cache_key(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(std::iter::once(&0u8)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Where compiled images are cached, from the environment (see the module docs); `None` when no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|k| std::env::var_os(k))
}

fn cache_dir_from(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let non_empty = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(root) = non_empty("REWIND_CACHE") {
        return Some(root.join("nvrtc"));
    }
    if let Some(xdg) = non_empty("XDG_CACHE_HOME") {
        return Some(xdg.join("rewind").join("nvrtc"));
    }
    non_empty("HOME").map(|h| h.join(".cache").join("rewind").join("nvrtc"))
}

fn cache_path(dir: &Path, module: &KernelModule, target: &str, key: u64) -> PathBuf {
    let ext = if target.starts_with("sm_") { "cubin" } else { "ptx" };
    dir.join(format!("{}-{target}-{key:016x}.{ext}", module.name))
}

fn key_for(source: &str, target: &str) -> Result<u64> {
    let (major, minor) = version()?;
    let ver = format!("nvrtc {major}.{minor}");
    let opts = options().join(" ");
    Ok(cache_key(&[
        source.as_bytes(),
        target.as_bytes(),
        opts.as_bytes(),
        ver.as_bytes(),
    ]))
}

/// The module's image for a device of compute capability `arch`, from the cache when present, else compiled (and
/// then cached).
pub fn compile_cached(module: &KernelModule, arch: (u32, u32)) -> Result<Image> {
    let target = target_for(arch, &supported_archs()?)?;
    let source = module.full_source();
    let key = key_for(&source, &target)?;
    let path = cache_dir().map(|d| cache_path(&d, module, &target, key));
    if let Some(bytes) = path
        .as_ref()
        .and_then(|p| std::fs::read(p).ok())
        .filter(|b| !b.is_empty())
    {
        return Ok(Image {
            kind: kind_of(&target),
            arch: target,
            bytes,
            cached: true,
        });
    }
    let image = compile(module.name, &source, &target)?;
    if let Some(p) = path {
        store(&p, &image.bytes);
    }
    Ok(image)
}

/// Compiles `module` for `target`, bypassing and then refreshing the cache.
pub fn compile_fresh(module: &KernelModule, target: &str) -> Result<Image> {
    let source = module.full_source();
    let image = compile(module.name, &source, target)?;
    if let Some(dir) = cache_dir() {
        store(
            &cache_path(&dir, module, target, key_for(&source, target)?),
            &image.bytes,
        );
    }
    Ok(image)
}

/// Compiles `module` for the real architecture `target` (`sm_XY`) into the on-disk cache ([`cache_dir`]), where a
/// device of that architecture opening later finds it instead of compiling: a machine without a GPU can warm the cache
/// a device run then carries (`rewind compile-kernels --fill-cache`). Returns the cached image's path; unlike the
/// opportunistic stores of a device run, a cache that cannot be written is an error here.
pub fn fill_cache(module: &KernelModule, target: &str) -> Result<PathBuf> {
    let dir = cache_dir().ok_or_else(|| {
        CudaError::Unavailable("no kernel cache directory: set REWIND_CACHE (or XDG_CACHE_HOME, or HOME)".into())
    })?;
    let source = module.full_source();
    let path = cache_path(&dir, module, target, key_for(&source, target)?);
    let image = compile(module.name, &source, target)?;
    store(&path, &image.bytes);
    match std::fs::read(&path) {
        Ok(bytes) if bytes == image.bytes => Ok(path),
        _ => Err(CudaError::Unavailable(format!(
            "could not write the kernel cache entry {}",
            path.display()
        ))),
    }
}

fn kind_of(target: &str) -> ImageKind {
    if target.starts_with("sm_") {
        ImageKind::Cubin
    } else {
        ImageKind::Ptx
    }
}

/// Writes through a temporary file and a rename, so a concurrent reader never sees half an image. Failures are
/// ignored: the cache is only an optimisation.
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Destroys the NVRTC program when dropped.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here.
        let _ = unsafe { nvrtc_result::destroy_program(self.0) };
    }
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles `source` (named `name` in the log) for `target` (`sm_XY` gives a CUBIN, `compute_XY` PTX). A rejected
/// source is [`CudaError::Compile`] with NVRTC's log.
pub fn compile(name: &str, source: &str, target: &str) -> Result<Image> {
    compile_with(name, source, target, &[]).map(|(image, _)| image)
}

/// [`compile`] with `extra` options after the usual ones; also returns NVRTC's log (ptxas's report among it).
pub(crate) fn compile_with(name: &str, source: &str, target: &str, extra: &[&str]) -> Result<(Image, String)> {
    probe_nvrtc()?;
    let src = CString::new(source).map_err(|_| CudaError::Nvrtc {
        context: format!("{name}: source contains a NUL byte"),
        status: "invalid input".into(),
    })?;
    let file = CString::new(format!("{name}.cu")).unwrap_or_default();
    let prog =
        Program(nvrtc_result::create_program(&src, Some(file.as_c_str())).map_err(nvrtc_err("nvrtcCreateProgram"))?);
    let mut options: Vec<String> = options().iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={target}"));
    options.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: `prog` is a live program.
    let compiled = unsafe { nvrtc_result::compile_program(prog.0, &options) };
    let log = unsafe { nvrtc_result::get_program_log(prog.0) }
        .map(|l| c_chars_to_string(&l))
        .unwrap_or_else(|le| format!("(no log: {})", status(le.0)));
    if let Err(e) = compiled {
        return Err(CudaError::Compile {
            module: name.to_string(),
            arch: target.to_string(),
            status: status(e.0),
            log,
        });
    }
    let kind = kind_of(target);
    let bytes = match kind {
        ImageKind::Cubin => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; the buffer has the size NVRTC reported.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(nvrtc_err("nvrtcGetCUBINSize"))?;
            let mut buf = vec![0u8; size];
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr().cast::<c_char>()) }
                .result()
                .map_err(nvrtc_err("nvrtcGetCUBIN"))?;
            buf
        }
        ImageKind::Ptx => {
            // SAFETY: `prog` compiled successfully.
            let ptx = unsafe { nvrtc_result::get_ptx(prog.0) }.map_err(nvrtc_err("nvrtcGetPTX"))?;
            c_chars_to_string(&ptx).into_bytes()
        }
    };
    if bytes.is_empty() {
        return Err(CudaError::Nvrtc {
            context: format!("{name}: NVRTC returned an empty image"),
            status: "empty".into(),
        });
    }
    let image = Image {
        arch: target.to_string(),
        kind,
        bytes,
        cached: false,
    };
    Ok((image, log))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn cache_key_depends_on_every_part() {
        let base = cache_key(&[b"src", b"sm_90", b"--std=c++17", b"nvrtc 13.0"]);
        assert_eq!(base, cache_key(&[b"src", b"sm_90", b"--std=c++17", b"nvrtc 13.0"]));
        assert_ne!(base, cache_key(&[b"src ", b"sm_90", b"--std=c++17", b"nvrtc 13.0"]));
        assert_ne!(base, cache_key(&[b"src", b"sm_80", b"--std=c++17", b"nvrtc 13.0"]));
        assert_ne!(base, cache_key(&[b"src", b"sm_90", b"", b"nvrtc 13.0"]));
        assert_ne!(base, cache_key(&[b"src", b"sm_90", b"--std=c++17", b"nvrtc 13.1"]));
        // Part boundaries count: "ab" + "c" differs from "a" + "bc".
        assert_ne!(cache_key(&[b"ab", b"c"]), cache_key(&[b"a", b"bc"]));
    }

    #[test]
    fn line_info_images_have_their_own_cache_key() {
        let (plain, lined) = (options_for(false).join(" "), options_for(true).join(" "));
        assert_eq!(plain, OPTIONS.join(" "));
        assert!(lined.ends_with(" -lineinfo"), "{lined}");
        let key = |o: &str| cache_key(&[b"src", b"sm_90", o.as_bytes(), b"nvrtc 13.0"]);
        assert_ne!(key(&plain), key(&lined));
    }

    #[test]
    fn cache_dir_precedence() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
        };
        assert_eq!(
            cache_dir_from(env(&[("REWIND_CACHE", "/c"), ("HOME", "/h")])),
            Some(PathBuf::from("/c/nvrtc"))
        );
        assert_eq!(
            cache_dir_from(env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")])),
            Some(PathBuf::from("/x/rewind/nvrtc"))
        );
        assert_eq!(
            cache_dir_from(env(&[("REWIND_CACHE", ""), ("HOME", "/h")])),
            Some(PathBuf::from("/h/.cache/rewind/nvrtc"))
        );
        assert_eq!(cache_dir_from(env(&[])), None);
    }

    #[test]
    fn target_choice() {
        let supported = [75, 80, 86, 89, 90, 100, 120];
        assert_eq!(target_for((9, 0), &supported).unwrap(), "sm_90");
        assert_eq!(target_for((9, 5), &supported).unwrap(), "compute_90");
        assert!(matches!(target_for((7, 0), &supported), Err(CudaError::Unavailable(_))));
    }

    #[test]
    fn module_names_cover_both_types() {
        let norm = MODULES.iter().find(|m| m.name == "norm").unwrap();
        let names = norm.function_names();
        assert!(names.contains(&"rms_norm_f32".to_string()) && names.contains(&"gated_rms_norm_bf16".to_string()));
        for m in MODULES {
            for k in m.kernels {
                assert!(m.source.contains(k), "{} does not define {k}", m.name);
            }
        }
    }

    /// A broken source comes back with NVRTC's log, where NVRTC can be loaded (it needs no GPU); without NVRTC the
    /// error says it is unavailable. Every real module is compiled for Hopper and Blackwell by
    /// `tests/nvrtc_compile.rs` (which `.ci/run` runs with NVRTC).
    #[test]
    fn compile_errors_carry_the_log() {
        if probe_nvrtc().is_err() {
            assert!(matches!(compile("x", "", "sm_90"), Err(CudaError::Unavailable(_))));
            eprintln!("NVRTC not found: compile checks skipped");
            return;
        }
        let bad = KernelModule {
            name: "broken",
            prelude: None,
            source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }\n",
            kernels: &["k"],
            typed: false,
        };
        match compile(bad.name, &bad.full_source(), "sm_90") {
            Err(CudaError::Compile { log, module, .. }) => {
                assert_eq!(module, "broken");
                assert!(log.contains("undefined_name") && log.contains("broken.cu(1)"), "{log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }
}
