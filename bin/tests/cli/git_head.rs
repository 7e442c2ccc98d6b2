//! The build script's commit lookup (`build/git_head.rs`): the commit of `HEAD` read from the git directory in a plain
//! checkout, a worktree, with packed refs and detached; and what it watches never includes the index, so `git
//! status` (which rewrites the index) does not make the next build recompile `rewind-bin`.

use std::fs;
use std::path::{Path, PathBuf};

#[path = "../../build/git_head.rs"]
mod build_script;

const ID: &str = "0123456789abcdef0123456789abcdef01234567";
const OTHER: &str = "fedcba9876543210fedcba9876543210fedcba98";

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rewind-git-head-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("mkdir");
    dir
}

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(path, text).expect("write");
}

fn index_watched(watch: &[PathBuf]) -> bool {
    watch.iter().any(|p| p.ends_with("index"))
}

#[test]
fn head_is_read_from_the_git_directory_without_the_index() {
    // A plain checkout on a branch with a loose ref.
    let root = scratch("plain");
    let git = root.join(".git");
    write(&git.join("HEAD"), "ref: refs/heads/main\n");
    write(&git.join("refs/heads/main"), &format!("{ID}\n"));
    write(&git.join("index"), "not watched");
    let h = build_script::head(&root);
    assert_eq!(h.commit.as_deref(), Some(ID));
    assert_eq!(
        h.watch,
        vec![git.join("HEAD"), git.join("refs/heads/main")],
        "only HEAD and the branch's file"
    );
    assert!(!index_watched(&h.watch), "{h:?}");

    // The branch only in packed-refs (peeled lines and comments skipped): packed-refs and the directory its next
    // commit writes its file into are watched.
    fs::remove_file(git.join("refs/heads/main")).expect("rm");
    write(
        &git.join("packed-refs"),
        &format!("# pack-refs with: peeled\n{OTHER} refs/heads/other\n{ID} refs/heads/main\n^{OTHER}\n"),
    );
    let h = build_script::head(&root);
    assert_eq!(h.commit.as_deref(), Some(ID));
    assert!(
        h.watch.contains(&git.join("packed-refs")) && h.watch.contains(&git.join("refs/heads")),
        "{h:?}"
    );
    assert!(
        h.watch.iter().all(|p| p.exists()),
        "a missing path would rerun the script on every build: {h:?}"
    );

    // Detached.
    write(&git.join("HEAD"), &format!("{OTHER}\n"));
    assert_eq!(build_script::head(&root).commit.as_deref(), Some(OTHER));
    let _ = fs::remove_dir_all(&root);
}

#[test]
fn a_worktree_reads_its_own_head_and_the_shared_branches() {
    let base = scratch("worktree");
    let common = base.join("main/.git");
    write(&common.join("refs/heads/feature"), &format!("{ID}\n"));
    write(&common.join("HEAD"), "ref: refs/heads/main\n");
    let wt_git = common.join("worktrees/wt");
    write(&wt_git.join("HEAD"), "ref: refs/heads/feature\n");
    write(&wt_git.join("commondir"), "../..\n");
    write(&wt_git.join("index"), "not watched");
    let root = base.join("wt");
    write(&root.join(".git"), &format!("gitdir: {}\n", wt_git.display()));
    let h = build_script::head(&root);
    assert_eq!(h.commit.as_deref(), Some(ID));
    assert!(h.watch.contains(&wt_git.join("HEAD")), "{h:?}");
    assert!(h.watch.iter().any(|p| p.ends_with("refs/heads/feature")), "{h:?}");
    assert!(!index_watched(&h.watch), "{h:?}");
    // No repository at all.
    let none = build_script::head(&scratch("none"));
    assert_eq!((none.commit, none.watch.len()), (None, 0));
    let _ = fs::remove_dir_all(&base);
}

/// This build's own build-script output (next to the binaries under test): it watches no index and only paths that
/// exist.
#[test]
fn this_build_watches_no_index() {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_rewind"));
    let build = bin.parent().expect("target dir").join("build");
    let outputs: Vec<(std::time::SystemTime, String)> = fs::read_dir(&build)
        .expect("the build directory")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("rewind-bin-"))
        .filter_map(|e| {
            let out = e.path().join("output");
            let text = fs::read_to_string(&out).ok()?;
            let when = fs::metadata(&out).and_then(|m| m.modified()).ok()?;
            text.contains("REWIND_GIT_COMMIT").then_some((when, text))
        })
        .collect();
    let (_, latest) = outputs
        .iter()
        .max_by_key(|(when, _)| *when)
        .expect("the build script's output");
    for line in latest.lines() {
        if let Some(path) = line.strip_prefix("cargo:rerun-if-changed=") {
            assert!(!path.ends_with("index"), "the build watches the index: {line}");
            let p = Path::new(path);
            let p = if p.is_absolute() {
                p.to_path_buf()
            } else {
                Path::new(env!("CARGO_MANIFEST_DIR")).join(p)
            };
            assert!(
                p.exists(),
                "a watched path is missing (the script would rerun every build): {line}"
            );
        }
    }
}
