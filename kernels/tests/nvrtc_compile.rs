//! Every kernel module compiles with NVRTC for the real architectures listed in `REWIND_NVRTC_CHECK` (e.g.
//! `sm_90,sm_100,sm_103`: Hopper and Blackwell) and has every entry point it declares, so a kernel that would fail to
//! build, or to load, on a device fails here first, without a GPU. The test command (README, `.ci/run`) fetches NVRTC
//! 13.0, the device machines' CUDA (`scripts/nvrtc.sh`), puts it on the library path and sets the variable; without
//! the variable there is no NVRTC to compile with, and the test says so and checks nothing. `rewind compile-kernels`
//! is the same check with a report.

#![cfg(feature = "cuda")]

use rewind_kernels::cuda::kernel_check::check_modules;
use rewind_kernels::cuda::nvrtc::{KernelModule, MODULES};

#[test]
fn every_kernel_module_compiles_for_the_listed_architectures() {
    let Ok(list) = std::env::var("REWIND_NVRTC_CHECK") else {
        eprintln!("REWIND_NVRTC_CHECK is not set: no kernel was compiled (.ci/run sets it)");
        return;
    };
    let targets: Vec<&str> = list.split(',').map(str::trim).filter(|t| !t.is_empty()).collect();
    assert!(!targets.is_empty(), "REWIND_NVRTC_CHECK names no target");
    let modules: Vec<&KernelModule> = MODULES.iter().collect();
    let mut problems = Vec::new();
    for (module, target, result) in check_modules(&modules, &targets) {
        match result {
            Ok(c) if c.missing.is_empty() => {}
            Ok(c) => problems.push(format!("{module} for {target} lacks {}", c.missing.join(", "))),
            Err(e) => problems.push(format!("{module} for {target}: {e}")),
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    eprintln!("{} modules compiled for {}", modules.len(), targets.join(", "));
}

/// The check itself can fail: an entry point a module declares but does not define is reported missing (a device
/// would fail to load it), and a source NVRTC rejects is an error naming the module.
#[test]
fn a_missing_entry_point_and_a_rejected_source_are_reported() {
    let Ok(list) = std::env::var("REWIND_NVRTC_CHECK") else {
        eprintln!("REWIND_NVRTC_CHECK is not set: nothing was compiled (.ci/run sets it)");
        return;
    };
    let target = list.split(',').next().unwrap_or("sm_90").trim();
    let lacking = KernelModule {
        name: "ci_lacking",
        source: "extern \"C\" __global__ void present(float* x) { x[threadIdx.x] = 1.0f; }",
        prelude: None,
        kernels: &["present", "absent"],
        typed: false,
    };
    let broken = KernelModule {
        name: "ci_broken",
        source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        ..lacking
    };
    let checks = check_modules(&[&lacking, &broken], &[target]);
    let c = checks[0].2.as_ref().expect("a valid module compiles");
    assert_eq!(c.missing, vec!["absent".to_string()]);
    assert_eq!(
        c.entries.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
        vec!["present"]
    );
    assert!(c.entries[0].registers > 0);
    let err = checks[1]
        .2
        .as_ref()
        .expect_err("an undefined name must not compile")
        .to_string();
    assert!(err.contains("ci_broken") && err.contains("undefined_name"), "{err}");
}

/// `rewind compile-kernels --fill-cache`'s store: an image compiled here for `sm_90` lands where a device of compute
/// capability 9.0 looks it up, and that lookup then reads it instead of compiling.
#[test]
fn a_filled_cache_is_what_a_device_reads() {
    use rewind_kernels::cuda::nvrtc::{compile_cached, fill_cache};
    if std::env::var("REWIND_NVRTC_CHECK").is_err() {
        eprintln!("REWIND_NVRTC_CHECK is not set: nothing was compiled (.ci/run sets it)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("rewind-nvrtc-cache-test-{}", std::process::id()));
    // Only this test reads the cache variable in this binary, so setting it cannot race another test.
    std::env::set_var("REWIND_CACHE", &dir);
    let module = MODULES.iter().find(|m| m.name == "cast").expect("the cast module");
    let path = fill_cache(module, "sm_90").expect("filling the cache");
    assert!(path.starts_with(dir.join("nvrtc")), "{}", path.display());
    let stored = std::fs::read(&path).expect("the cached image");
    let image = compile_cached(module, (9, 0)).expect("the device's lookup");
    assert!(
        image.cached,
        "a device of 9.0 compiled instead of reading {}",
        path.display()
    );
    assert_eq!(image.bytes, stored);
    let _ = std::fs::remove_dir_all(&dir);
}
