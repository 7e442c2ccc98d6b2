//! GPU profiles: the four numbers of a GPU that the projection uses (memory, HBM bandwidth, dense bf16 tensor
//! throughput, NVLink bandwidth), plus the inter-node bandwidth and a per-collective latency. The built-in profiles
//! come from NVIDIA's published specifications; `docs/gpu-profiles.md` lists each number with its source.
//!
//! Units and conventions (every profile, built-in or `--gpu-spec FILE`):
//! - `memory_gb`: decimal gigabytes (10⁹ bytes) as the datasheet prints them;
//! - `hbm_tb_s`: HBM bandwidth in TB/s (10¹² bytes/s), read and write together (what a copy kernel shares);
//! - `bf16_dense_tflops`: dense (not 2:4 sparse) bf16 tensor-core TFLOP/s; NVIDIA's tables print the sparse figure,
//!   twice this;
//! - `nvlink_gb_s`: NVLink bandwidth of one GPU **per direction** in GB/s; NVIDIA prints the bidirectional total
//!   (900 GB/s for Hopper, 1.8 TB/s for Blackwell), twice this;
//! - `inter_node_gb_s`: network bandwidth of one GPU per direction in GB/s (its NIC), needed only with `--nodes` > 1;
//! - `collective_latency_us`: the fixed cost of one all-reduce, an **assumption** of this model, not a datasheet
//!   number (NCCL's small-message all-reduce on one NVLink domain costs microseconds; 0 gives the pure bandwidth model).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::PlanError;

/// One GPU kind, as the projection sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuProfile {
    /// Short name (`h100`, `b300`, or the file's own).
    pub name: String,
    /// What the profile describes, e.g. `NVIDIA H100 SXM5 80GB`.
    #[serde(default)]
    pub description: String,
    /// Device memory, decimal GB.
    pub memory_gb: f64,
    /// HBM bandwidth, TB/s.
    pub hbm_tb_s: f64,
    /// Dense bf16 tensor-core throughput, TFLOP/s.
    pub bf16_dense_tflops: f64,
    /// NVLink bandwidth per GPU per direction, GB/s.
    pub nvlink_gb_s: f64,
    /// Network bandwidth per GPU per direction between nodes, GB/s (`None`: single-node profiles only).
    #[serde(default)]
    pub inter_node_gb_s: Option<f64>,
    /// Fixed cost of one all-reduce in microseconds (an assumption, see the module docs).
    #[serde(default)]
    pub collective_latency_us: f64,
    /// Where the numbers come from.
    #[serde(default)]
    pub sources: Vec<String>,
}

/// The latency assumed for one NCCL all-reduce inside an NVLink domain, in microseconds. Not from a datasheet: the
/// calibration against the committed 2 × H200 tensor-parallel run (`plan::calibration`) shows how far it holds.
pub const NVLINK_COLLECTIVE_LATENCY_US: f64 = 10.0;

const NVIDIA_H100: &str = "https://www.nvidia.com/en-us/data-center/h100/";
const NVIDIA_H200: &str = "https://www.nvidia.com/en-us/data-center/h200/";
const NVIDIA_HGX: &str = "https://www.nvidia.com/en-us/data-center/hgx/";
const NVIDIA_DGX_B200: &str = "https://www.nvidia.com/en-us/data-center/dgx-b200/";
const NVIDIA_DGX_B300: &str = "https://www.nvidia.com/en-us/data-center/dgx-b300/";

fn builtin(name: &str) -> Option<GpuProfile> {
    let p =
        |description: &str, memory_gb, hbm_tb_s, bf16_dense_tflops, nvlink_gb_s, inter_node_gb_s, sources: &[&str]| {
            GpuProfile {
                name: name.to_string(),
                description: description.to_string(),
                memory_gb,
                hbm_tb_s,
                bf16_dense_tflops,
                nvlink_gb_s,
                inter_node_gb_s: Some(inter_node_gb_s),
                collective_latency_us: NVLINK_COLLECTIVE_LATENCY_US,
                sources: sources.iter().map(|s| s.to_string()).collect(),
            }
        };
    // Values and their sources: docs/gpu-profiles.md. bf16: NVIDIA's sparse figure halved; NVLink: the bidirectional
    // total halved; inter-node: the NIC per GPU of the DGX system (400 Gb/s ConnectX-7, 800 Gb/s ConnectX-8).
    Some(match name {
        "h100" => p(
            "NVIDIA H100 SXM5 80GB (HBM3)",
            80.0,
            3.35,
            989.0,
            450.0,
            50.0,
            &[NVIDIA_H100, "https://glennklockwood.com/garden/processors/h100"],
        ),
        "h200" => p(
            "NVIDIA H200 SXM 141GB (HBM3e)",
            141.0,
            4.8,
            989.0,
            450.0,
            50.0,
            &[NVIDIA_H200, "https://www.saulelectric.com/nvidia-h200.html"],
        ),
        "b200" => p(
            "NVIDIA B200 (HGX / DGX B200, 180GB HBM3e per GPU)",
            180.0,
            8.0,
            2250.0,
            900.0,
            50.0,
            &[
                NVIDIA_HGX,
                NVIDIA_DGX_B200,
                "https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview",
                "https://fibermall.com/blog/?p=17161",
            ],
        ),
        "b300" => p(
            "NVIDIA B300 Blackwell Ultra (HGX / DGX B300, 288GB HBM3e per GPU)",
            288.0,
            8.0,
            2250.0,
            900.0,
            100.0,
            &[
                NVIDIA_HGX,
                NVIDIA_DGX_B300,
                "https://acecloud.ai/blog/nvidia-hgx-b300",
                "https://fibermall.com/blog/?p=17161",
            ],
        ),
        _ => return None,
    })
}

/// Names of the built-in profiles.
pub const BUILTIN_GPUS: [&str; 4] = ["h100", "h200", "b200", "b300"];

impl GpuProfile {
    /// A built-in profile by `--gpu` name.
    pub fn builtin(name: &str) -> Result<Self, PlanError> {
        builtin(&name.to_ascii_lowercase()).ok_or_else(|| PlanError::UnknownGpu {
            name: name.to_string(),
            known: BUILTIN_GPUS.join(", "),
        })
    }

    /// Reads a `--gpu-spec` JSON file and checks it.
    pub fn from_file(path: &Path) -> Result<Self, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|e| PlanError::ProfileFile {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Self::from_json(&text).map_err(|e| match e {
            PlanError::ProfileJson(message) => PlanError::ProfileFile {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    /// Parses a profile from JSON text and checks it.
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        let profile: GpuProfile = serde_json::from_str(text).map_err(|e| PlanError::ProfileJson(e.to_string()))?;
        profile.validate()?;
        Ok(profile)
    }

    /// Every number finite and in range: bandwidths, throughput and memory positive, the latency not negative.
    pub fn validate(&self) -> Result<(), PlanError> {
        let positive = [
            ("memory_gb", Some(self.memory_gb)),
            ("hbm_tb_s", Some(self.hbm_tb_s)),
            ("bf16_dense_tflops", Some(self.bf16_dense_tflops)),
            ("nvlink_gb_s", Some(self.nvlink_gb_s)),
            ("inter_node_gb_s", self.inter_node_gb_s),
        ];
        for (field, value) in positive {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    return Err(PlanError::ProfileField {
                        profile: self.name.clone(),
                        field,
                        message: format!("must be a positive number, got {v}"),
                    });
                }
            }
        }
        if !(self.collective_latency_us.is_finite() && self.collective_latency_us >= 0.0) {
            return Err(PlanError::ProfileField {
                profile: self.name.clone(),
                field: "collective_latency_us",
                message: format!("must be zero or positive, got {}", self.collective_latency_us),
            });
        }
        if self.name.trim().is_empty() {
            return Err(PlanError::ProfileField {
                profile: String::new(),
                field: "name",
                message: "must not be empty".into(),
            });
        }
        Ok(())
    }

    /// Device memory in bytes.
    pub fn memory_bytes(&self) -> f64 {
        self.memory_gb * 1e9
    }

    /// HBM bandwidth in bytes per second.
    pub fn hbm_bytes_per_s(&self) -> f64 {
        self.hbm_tb_s * 1e12
    }

    /// Dense bf16 FLOP/s.
    pub fn flops_per_s(&self) -> f64 {
        self.bf16_dense_tflops * 1e12
    }
}
