//! Quantized checkpoints from the command line: `init-model --quant` writes each published layout, every command
//! loads it (saying that the weights are dequantized), and its logits stay near the float model's.

use crate::common;

use common::{rewind, stderr};

fn logits(model: &str, out: &std::path::Path) -> Vec<Vec<f32>> {
    let o = rewind(&[
        "logits",
        "--model",
        model,
        "--tokens",
        "5,17,42,7,99,3",
        "--prefill",
        "3",
        "--out",
        out.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("dequantized when loaded") == model.contains("quant"),
        "{}",
        stderr(&o)
    );
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out).expect("read")).expect("json");
    serde_json::from_value(json["logits"].clone()).expect("rows")
}

#[test]
fn every_quantized_layout_loads_and_stays_near_the_float_model() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let float = tmp.path().join("float");
    let o = rewind(&[
        "init-model",
        "--arch",
        "qwen3_5",
        "--preset",
        "tiny",
        "--seed",
        "3",
        "--out",
        float.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = logits(float.to_str().unwrap(), &tmp.path().join("float.json"));
    for (layout, bound) in [("fp8-block", 0.2), ("modelopt-fp8", 0.2), ("nvfp4", 0.8)] {
        let dir = tmp.path().join(format!("quant-{layout}"));
        let d = dir.to_str().unwrap();
        let o = rewind(&[
            "init-model",
            "--arch",
            "qwen3_5",
            "--preset",
            "tiny",
            "--seed",
            "3",
            "--quant",
            layout,
            "--out",
            d,
        ]);
        assert!(o.status.success(), "{layout}: {}", stderr(&o));
        assert!(stderr(&o).contains("quantized"), "{}", stderr(&o));
        let got = logits(d, &tmp.path().join(format!("{layout}.json")));
        for (g, w) in got.iter().zip(&want) {
            let top = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff > 0.0 && diff / top < bound,
                "{layout}: max difference {diff} of {top}"
            );
        }
    }
}

#[test]
fn an_unknown_layout_is_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("m");
    let o = rewind(&[
        "init-model",
        "--arch",
        "qwen3_5",
        "--preset",
        "tiny",
        "--quant",
        "int3",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("unknown --quant `int3`"), "{}", stderr(&o));
    assert!(!out.exists());
}

#[test]
fn quantize_copies_a_checkpoint_and_leaves_the_original_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let float = tmp.path().join("float");
    let o = rewind(&[
        "init-model",
        "--arch",
        "nemotron_h",
        "--preset",
        "tiny",
        "--out",
        float.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = std::fs::read(float.join("config.json")).expect("config");
    let out = tmp.path().join("q");
    let o = rewind(&[
        "quantize",
        "--model",
        float.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quant",
        "nvfp4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(float.join("config.json")).expect("config"), before);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).expect("config")).expect("json");
    assert_eq!(config["quantization_config"]["quant_algo"], "NVFP4");
    assert!(out.join("tokenizer.json").is_file());
    let o = rewind(&[
        "generate",
        "--model",
        out.to_str().unwrap(),
        "--max-tokens",
        "4",
        "hello",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A second quantization of the same output is refused: it is not empty.
    let o = rewind(&[
        "quantize",
        "--model",
        float.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quant",
        "nvfp4",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("not empty"),
        "{}",
        stderr(&o)
    );
}
