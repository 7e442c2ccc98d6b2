//! Quantized checkpoints end to end: the published layouts (fixtures written by
//! `scripts/reference/quant_fixtures.py`, dequantized there by an independent implementation) read back exactly,
//! every inconsistency an error naming the tensor, and `quantize_in_place` round trips on whole models.

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use super::quantize::{quantizable, quantize_in_place};
use super::{Method, Quantization};
use crate::checkpoint::SafetensorsSource;
use crate::init::tiny_checkpoint;
use crate::model::tensors::TensorSource;
use crate::model::Family;
use rewind_kernels::cpu::quant::f32_to_e4m3;

fn fixture(layout: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/quant")
        .join(layout)
}

#[test]
fn published_quantized_layouts_dequantize_like_the_reference() {
    for layout in ["fp8-block", "modelopt-fp8", "nvfp4"] {
        let dir = fixture(layout);
        let mut expected = SafetensorsSource::open_file(&dir.join("expected.safetensors")).expect("expected");
        let mut src = SafetensorsSource::open(&dir).expect(layout);
        assert!(src.quantization().is_some(), "{layout}");
        for name in expected.names() {
            let shape = expected.shape_of(&name).expect("shape");
            assert_eq!(
                src.shape_of(&name),
                Some(shape.clone()),
                "{layout} {name}: logical shape"
            );
            let want = expected.take(&name, &shape).expect("expected tensor");
            let got = src
                .take(&name, &shape)
                .unwrap_or_else(|e| panic!("{layout} {name}: {e}"));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{layout} {name}");
        }
        // The scales went with their weights; the activation scales are set aside, not reported.
        src.finish(&[], &[]).unwrap_or_else(|e| panic!("{layout}: {e}"));
    }
}

/// A one-weight checkpoint in `dir` with `config`'s quantization_config and the raw `tensors`.
fn write(dir: &Path, config: serde_json::Value, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::json!({ "quantization_config": config }).to_string(),
    )
    .unwrap();
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn err(dir: &Path, name: &str, shape: &[usize]) -> String {
    let mut src = match SafetensorsSource::open(dir) {
        Ok(s) => s,
        Err(e) => return e.to_string(),
    };
    src.take(name, shape).expect_err("must fail").to_string()
}

#[test]
fn inconsistent_quantized_tensors_are_errors_naming_them() {
    let block = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]});
    let codes = vec![f32_to_e4m3(1.0); 4 * 130];
    let one = 1f32.to_le_bytes().to_vec();
    let dir = tempfile::tempdir().unwrap();
    // No scale.
    write(
        dir.path(),
        block.clone(),
        &[("w.weight", Dtype::F8_E4M3, vec![4, 130], codes.clone())],
    );
    let e = err(dir.path(), "w.weight", &[4, 130]);
    assert!(
        e.contains("`w.weight`") && e.contains("w.weight_scale_inv` is missing"),
        "{e}"
    );
    // A scale grid that does not cover the partial block.
    let scales = [one.clone(), one.clone()].concat();
    write(
        dir.path(),
        block.clone(),
        &[
            ("w.weight", Dtype::F8_E4M3, vec![4, 130], codes.clone()),
            ("w.weight_scale_inv", Dtype::F32, vec![1, 1], one.clone()),
            ("v.weight_scale_inv", Dtype::F32, vec![2], scales),
        ],
    );
    let e = err(dir.path(), "w.weight", &[4, 130]);
    assert!(e.contains("[1, 1]") && e.contains("[1, 2]"), "{e}");
    // A quantized tensor in a checkpoint whose config says nothing about quantization.
    std::fs::write(dir.path().join("config.json"), "{}").unwrap();
    let e = err(dir.path(), "w.weight", &[4, 130]);
    assert!(e.contains("`w.weight`") && e.contains("no quantization_config"), "{e}");
    // NVFP4: wrong scale dtype; then columns that are not whole groups.
    let nv = serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4"});
    write(
        dir.path(),
        nv.clone(),
        &[
            ("w.weight", Dtype::U8, vec![2, 16], vec![0; 32]),
            ("w.weight_scale", Dtype::F32, vec![2, 2], vec![0; 16]),
            ("w.weight_scale_2", Dtype::F32, vec![], one.clone()),
        ],
    );
    let e = err(dir.path(), "w.weight", &[2, 32]);
    assert!(e.contains("expected F8_E4M3 [2, 2]"), "{e}");
    write(dir.path(), nv, &[("w.weight", Dtype::U8, vec![2, 4], vec![0; 8])]);
    let e = err(dir.path(), "w.weight", &[2, 8]);
    assert!(e.contains("not a whole number of 16-element groups"), "{e}");
    // An unknown method fails at open, naming it.
    write(
        dir.path(),
        serde_json::json!({"quant_method": "awq"}),
        &[("w.weight", Dtype::F32, vec![1], one)],
    );
    let e = err(dir.path(), "w.weight", &[1]);
    assert!(e.contains("quantization method `awq`"), "{e}");
}

/// The largest error of `got` against `want`, relative to the largest |want|.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    let top = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / top
}

#[test]
fn quantize_in_place_round_trips_every_layout_on_whole_models() {
    for family in [Family::NemotronH, Family::Qwen35] {
        let float = tiny_checkpoint(family, 7);
        for (method, bound) in [
            (
                Method::Fp8 {
                    block: Some([128, 128]),
                },
                0.07,
            ),
            (Method::ModelOptFp8, 0.07),
            (Method::Nvfp4 { group: 16 }, 0.3),
        ] {
            let dir = tempfile::tempdir().unwrap();
            for f in std::fs::read_dir(float.path()).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
            }
            let report = quantize_in_place(dir.path(), method).expect("quantize");
            assert!(report.quantized > 0 && report.kept > 0, "{report:?}");
            assert_eq!(Quantization::read(dir.path()).unwrap().map(|q| q.method), Some(method));
            let mut a = SafetensorsSource::open(float.path()).unwrap();
            let mut q = SafetensorsSource::open(dir.path()).unwrap();
            let mut checked = 0;
            for name in a.names() {
                let shape = a.shape_of(&name).unwrap();
                let want = a.take(&name, &shape).unwrap();
                let got = q
                    .take(&name, &shape)
                    .unwrap_or_else(|e| panic!("{method:?} {name}: {e}"));
                if quantizable(&name, &shape, method) {
                    let e = relative_error(&got, &want);
                    assert!(e > 0.0 && e < bound, "{method:?} {name}: relative error {e}");
                    checked += 1;
                } else {
                    assert_eq!(got, want, "{method:?} {name} is kept as it was");
                }
            }
            assert_eq!(checked, report.quantized);
            q.finish(&[], &[]).unwrap();
            // The model loads from it like from any checkpoint.
            crate::shard::ShardedModel::from_dir(dir.path(), 2, 1).unwrap_or_else(|e| panic!("{method:?}: {e}"));
            let again = quantize_in_place(dir.path(), method).unwrap_err().to_string();
            assert!(again.contains("already quantized"), "{again}");
        }
    }
}
