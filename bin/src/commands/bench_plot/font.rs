//! The font of the plots' text: `--font`, else the first of the usual system paths, registered with plotters.
//!
//! plotters is built with `ab_glyph` rather than `ttf` so that no freetype / fontconfig C library is needed; the
//! price is that nothing finds fonts for us, so a TrueType file is read here and registered under the family name
//! every chart asks for ([`FAMILY`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use anyhow::{anyhow, bail, Context, Result};
use plotters::style::{register_font, FontStyle};

/// The family name the charts use (and plotters' own default for axis labels).
pub const FAMILY: &str = "sans-serif";

/// Where a sans-serif TrueType font usually lives (Debian / Ubuntu, Fedora, Arch, Liberation, macOS), in order.
pub const DEFAULT_FONTS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// The font to use: `explicit` (which must exist), else the first existing of `candidates`.
pub fn resolve(explicit: Option<&Path>, candidates: &[&str]) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!("--font {}: no such file", p.display());
        }
        return Ok(p.to_path_buf());
    }
    if let Some(p) = candidates.iter().map(Path::new).find(|p| p.is_file()) {
        return Ok(p.to_path_buf());
    }
    bail!(
        "no font found for the plot labels (tried {}); pass a TrueType font with --font FILE",
        candidates.join(", ")
    )
}

/// Resolves the font (see [`resolve`], with [`DEFAULT_FONTS`]) and registers it as [`FAMILY`]; returns its path.
pub fn load(explicit: Option<&Path>) -> Result<PathBuf> {
    let path = resolve(explicit, &DEFAULT_FONTS)?;
    register(&path)?;
    Ok(path)
}

/// Reads the font at `path` and registers it as [`FAMILY`].
pub fn register(path: &Path) -> Result<()> {
    // plotters keeps fonts as `&'static [u8]`, so the bytes are leaked; once per path, so that repeated runs in one
    // process (the tests) do not leak a copy each.
    static LEAKED: OnceLock<Mutex<HashMap<PathBuf, &'static [u8]>>> = OnceLock::new();
    let bytes = {
        let mut leaked = LEAKED
            .get_or_init(Default::default)
            .lock()
            .map_err(|_| anyhow!("the font table's lock is poisoned"))?;
        match leaked.get(path) {
            Some(&b) => b,
            None => {
                let data = std::fs::read(path).with_context(|| format!("cannot read the font {}", path.display()))?;
                let b: &'static [u8] = Box::leak(data.into_boxed_slice());
                leaked.insert(path.to_path_buf(), b);
                b
            }
        }
    };
    register_font(FAMILY, FontStyle::Normal, bytes).map_err(|_| {
        anyhow!(
            "font {}: not a TrueType / OpenType font that can be parsed",
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_plot_font_missing_explicit_path_is_named() {
        let e = resolve(Some(Path::new("/nonexistent/Font.ttf")), &DEFAULT_FONTS).map_err(|e| e.to_string());
        assert_eq!(e, Err("--font /nonexistent/Font.ttf: no such file".to_string()));
    }

    #[test]
    fn bench_plot_font_none_found_lists_the_paths_tried() {
        let e = resolve(None, &["/nonexistent/a.ttf", "/nonexistent/b.ttf"]).map_err(|e| e.to_string());
        let e = e.err().unwrap_or_default();
        assert!(
            e.contains("/nonexistent/a.ttf, /nonexistent/b.ttf") && e.contains("--font"),
            "{e}"
        );
    }

    #[test]
    fn bench_plot_font_that_does_not_parse_is_named() {
        let dir = std::env::temp_dir().join(format!("rewind-bench-plot-font-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("not-a-font.ttf");
        std::fs::write(&bad, b"this is not a font").unwrap();
        let e = load(Some(&bad)).map_err(|e| e.to_string()).err().unwrap_or_default();
        assert!(e.contains("not-a-font.ttf") && e.contains("not a TrueType"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
