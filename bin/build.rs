//! Records the commit the binary is built from (`REWIND_GIT_COMMIT`), so benchmark reports name the source they
//! measured even where the binary runs without the repository; and compiles the gRPC API
//! (`proto/rewind/v1/rewind.proto`) into the server and client code `serve::grpc::pb` includes.
//!
//! The commit is read from `HEAD` and the branch it names, and only those are watched: no `-dirty` mark, since
//! knowing about uncommitted changes means watching the index, which every `git status` rewrites (and each rewrite
//! would rebuild this crate).

#[path = "build/git_head.rs"]
mod git_head;

/// Generates the gRPC messages, server and client. protoc comes from `protoc-bin-vendored` (CI machines have none)
/// unless `PROTOC` names one.
fn compile_protos() {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path().expect("protoc-bin-vendored has no protoc for this host");
        // Build scripts run single-threaded here, so setting the variable races with no reader.
        std::env::set_var("PROTOC", protoc);
    }
    // Serialize: `rewind client --json` prints the messages as they are; enum fields print as their names.
    let name = |f: &str| format!("#[serde(serialize_with = \"crate::serve::grpc::json::{f}\")]");
    tonic_prost_build::configure()
        .type_attribute(".rewind.v1", "#[derive(serde::Serialize)]")
        .field_attribute("rewind.v1.GenerateChunk.finish_reason", name("finish_reason"))
        .field_attribute("rewind.v1.HealthResponse.status", name("serving_status"))
        .field_attribute("rewind.v1.StatsResponse.status", name("serving_status"))
        .compile_protos(&["proto/rewind/v1/rewind.proto"], &["proto"])
        .expect("compiling proto/rewind/v1/rewind.proto");
    // Stated here too: the build script's other `rerun-if-changed` lines would otherwise hide a proto edit.
    println!("cargo:rerun-if-changed=proto");
}

fn main() {
    compile_protos();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let head = git_head::head(&root);
    // Git's usual short form.
    let commit = head
        .commit
        .map_or_else(|| "unknown".into(), |c| c.chars().take(7).collect::<String>());
    println!("cargo:rustc-env=REWIND_GIT_COMMIT={commit}");
    for path in &head.watch {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
