//! The commit a checkout's `HEAD` names, read from the git directory's files rather than by running git: `git
//! status` would read (and refresh) the index, and a build that watches the index is invalidated by every `git
//! status` a user runs. Shared by `build.rs` and its test (`tests/git_head.rs`).

use std::fs;
use std::path::{Path, PathBuf};

/// What `HEAD` names in the checkout at `root`, and the files and directories whose changes can change that.
#[derive(Debug, PartialEq, Eq)]
pub struct Head {
    /// The full commit id; `None` when it cannot be read (no repository, an unborn branch).
    pub commit: Option<String>,
    /// For `cargo:rerun-if-changed`: only paths that exist (cargo reruns a script on every build for a missing one).
    pub watch: Vec<PathBuf>,
}

/// The git directory of the checkout at `root` (`.git`, or in a worktree the directory its `.git` file names) and
/// the common directory that holds the branches (the same directory outside worktrees).
fn git_dirs(root: &Path) -> Option<(PathBuf, PathBuf)> {
    let dot = root.join(".git");
    let git_dir = if dot.is_dir() {
        dot
    } else {
        let text = fs::read_to_string(&dot).ok()?;
        let named = PathBuf::from(text.trim().strip_prefix("gitdir:")?.trim());
        root.join(named)
    };
    let common = match fs::read_to_string(git_dir.join("commondir")) {
        Ok(c) => git_dir.join(c.trim()),
        Err(_) => git_dir.clone(),
    };
    Some((git_dir, common))
}

/// The commit of `name` (`refs/heads/main`) in `packed-refs` text.
fn packed(text: &str, name: &str) -> Option<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with('^'))
        .find_map(|l| match l.split_once(' ') {
            Some((id, n)) if n.trim() == name => Some(id.to_string()),
            _ => None,
        })
}

/// Reads what `HEAD` names in the checkout at `root`; see [`Head`].
pub fn head(root: &Path) -> Head {
    let Some((git_dir, common)) = git_dirs(root) else {
        return Head {
            commit: None,
            watch: Vec::new(),
        };
    };
    let head_file = git_dir.join("HEAD");
    let mut watch = vec![head_file.clone()];
    let text = fs::read_to_string(&head_file).unwrap_or_default();
    let text = text.trim();
    let commit = match text.strip_prefix("ref:") {
        // A detached HEAD holds the commit itself.
        None => (!text.is_empty()).then(|| text.to_string()),
        Some(name) => {
            let name = name.trim();
            let loose = common.join(name);
            let packed_refs = common.join("packed-refs");
            match fs::read_to_string(&loose) {
                // The branch's own file: a commit rewrites it. Not its directory, which every other branch of a
                // shared repository (worktrees) changes too.
                Ok(id) => {
                    watch.push(loose);
                    Some(id.trim().to_string())
                }
                // Only in packed-refs: the branch's next commit makes its loose file, which shows in its directory.
                Err(_) => {
                    if let Some(dir) = loose.parent() {
                        watch.push(dir.to_path_buf());
                    }
                    watch.push(packed_refs.clone());
                    fs::read_to_string(&packed_refs).ok().and_then(|t| packed(&t, name))
                }
            }
        }
    };
    watch.retain(|p| p.exists());
    Head { commit, watch }
}
