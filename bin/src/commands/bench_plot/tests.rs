//! End-to-end tests of `rewind bench plot`: synthetic results written to a temporary directory, read back and drawn.

use std::path::{Path, PathBuf};

use super::fixtures::{e2e_json, kernels_json, peers_json};
use super::*;

/// A fresh directory under the system temp dir, unique to this process and test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rewind-bench-plot-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, v: &serde_json::Value) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string_pretty(v).unwrap()).unwrap();
    p
}

#[test]
fn bench_plot_reads_the_three_kinds_from_files() {
    let dir = temp_dir("read");
    let kinds: Vec<&str> = [
        ("e.json", e2e_json()),
        ("k.json", kernels_json()),
        ("p.json", peers_json()),
    ]
    .iter()
    .map(|(n, v)| match inputs::read(&write(&dir, n, v)).map(|i| i.data) {
        Ok(InputData::E2e(_)) => "e2e",
        Ok(InputData::Kernels(_)) => "kernels",
        Ok(InputData::Peers(_)) => "peers",
        Err(e) => panic!("{e:#}"),
    })
    .collect();
    assert_eq!(kinds, ["e2e", "kernels", "peers"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_plot_unknown_kind_names_the_file() {
    let dir = temp_dir("unknown");
    let p = write(
        &dir,
        "mystery.json",
        &serde_json::json!({"kind": "rewind-bench-mystery", "rows": []}),
    );
    let e = inputs::read(&p)
        .map(|_| ())
        .map_err(|e| format!("{e:#}"))
        .err()
        .unwrap_or_default();
    assert!(
        e.contains(&p.display().to_string()) && e.contains("unknown benchmark kind"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_plot_missing_font_is_an_error() {
    let dir = temp_dir("nofont");
    let args = BenchPlotArgs {
        input: vec![write(&dir, "e.json", &e2e_json())],
        out_dir: dir.join("out"),
        font: Some(dir.join("missing.ttf")),
    };
    let e = run(args).map_err(|e| format!("{e:#}")).err().unwrap_or_default();
    assert!(e.contains("missing.ttf: no such file"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Draws every chart of an e2e, a kernels and a peers result with the system font; where this machine has none of
/// the default fonts, the run must fail with the error that says so instead.
#[test]
fn bench_plot_draws_every_chart_and_the_index() {
    let dir = temp_dir("draw");
    let mut e2e = e2e_json();
    // A model whose steps all lack a roofline: its roofline chart is skipped with a note, not an error.
    let mut bare = e2e["models"][0].clone();
    bare["name"] = "bare model".into();
    for s in bare["steps"].as_array_mut().into_iter().flatten() {
        s["roofline_ms"] = serde_json::Value::Null;
        s["roofline_fraction"] = serde_json::Value::Null;
    }
    e2e["models"].as_array_mut().unwrap().push(bare);
    let out_dir = dir.join("plots");
    let args = BenchPlotArgs {
        input: vec![
            write(&dir, "e2e.json", &e2e),
            write(&dir, "kernels.json", &kernels_json()),
            write(&dir, "peers.json", &peers_json()),
        ],
        out_dir: out_dir.clone(),
        font: None,
    };
    let have_font = font::DEFAULT_FONTS.iter().any(|p| Path::new(p).is_file());
    let result = run(args);
    if !have_font {
        let e = result.map_err(|e| format!("{e:#}")).err().unwrap_or_default();
        assert!(e.contains("no font found") && e.contains("--font"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        return;
    }
    if let Err(e) = result {
        panic!("{e:#}");
    }
    let md = std::fs::read_to_string(out_dir.join("plots.md")).unwrap();
    let pngs = [
        "e2e-nemotron-h-8b-step-ms.png",
        "e2e-nemotron-h-8b-tokens.png",
        "e2e-nemotron-h-8b-roofline.png",
        "e2e-bare-model-step-ms.png",
        "e2e-bare-model-tokens.png",
        "kernels-mamba2-bandwidth.png",
        "kernels-gdn-bandwidth.png",
    ];
    for name in pngs {
        let bytes = std::fs::read(out_dir.join(name)).unwrap_or_default();
        assert!(bytes.len() > 10_000, "{name}: {} bytes", bytes.len());
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{name} is not a PNG");
        assert!(
            md.contains(&format!("]({name})")),
            "plots.md does not link {name}:\n{md}"
        );
    }
    // Skipped for lack of data, and said so.
    assert!(!out_dir.join("e2e-bare-model-roofline.png").exists());
    assert!(md.contains("e2e-bare-model-roofline.png not drawn"), "{md}");
    assert!(md.contains("kv-only roofline"), "{md}");
    // Tables: an e2e step row and a kernel row compared with its peer.
    assert!(md.contains("| spec | 8 | 3 of 4 |"), "{md}");
    assert!(md.contains("(mamba_ssm selective_state_update)"), "{md}");
    std::fs::remove_dir_all(&dir).unwrap();
}
