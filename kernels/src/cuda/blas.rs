//! GEMMs in the shape of a linear layer, `out[rows, out] = x[rows, in] · W[out, in]ᵀ`, with bf16 operands and f32
//! accumulation, through cuBLAS (`cublasGemmEx`, f32 or bf16 output) and cuBLASLt (bf16 output, optional fused bias).
//!
//! Row-major `x` and `W` read as column-major are `xᵀ [in, rows]` and `Wᵀ [in, out]`, so the column-major product
//! `outᵀ = op(Wᵀ)ᵀ · xᵀ` is a GEMM with `transa = T`, `m = out`, `n = rows`, `k = in`, all leading dimensions natural.

use std::sync::Arc;

use cudarc::cublas::{self, CudaBlas};
use cudarc::cublaslt::{self, CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::device::{probe_driver, CudaDevice, Elem};
use super::{check_len, check_linear, ensure, CudaError, Result};

fn blas_err(context: &str) -> impl FnOnce(cublas::result::CublasError) -> CudaError + '_ {
    move |e| CudaError::Blas {
        context: context.to_string(),
        status: format!("{:?}", e.0),
    }
}

/// cuBLAS and cuBLASLt handles bound to one device's stream.
pub struct Blas {
    blas: CudaBlas,
    lt: CudaBlasLT,
    stream: Arc<CudaStream>,
    /// cuBLAS's workspace, owned here rather than left to the library: a GEMM captured in a CUDA graph must not
    /// allocate, and every replay must see the same buffer.
    _workspace: CudaSlice<u8>,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas").finish_non_exhaustive()
    }
}

fn dims_i32(op: &'static str, rows: usize, in_dim: usize, out_dim: usize) -> Result<(i32, i32, i32)> {
    let fit = |v: usize| i32::try_from(v).ok();
    match (fit(rows), fit(in_dim), fit(out_dim)) {
        (Some(r), Some(i), Some(o)) => Ok((r, i, o)),
        _ => Err(CudaError::Shape {
            op,
            message: format!("dimensions {rows} × {in_dim} → {out_dim} exceed i32"),
        }),
    }
}

impl Blas {
    /// Creates the handles on `dev`'s stream; `Unavailable` when libcublas / libcublasLt cannot be loaded.
    pub fn new(dev: &CudaDevice) -> Result<Self> {
        probe_driver()?;
        // SAFETY: these only try to dlopen the libraries.
        if !unsafe { cublas::sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "cuBLAS (libcublas.so.13) cannot be loaded; put the CUDA library directory on LD_LIBRARY_PATH".into(),
            ));
        }
        if !unsafe { cublaslt::sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "cuBLASLt (libcublasLt.so.13) cannot be loaded; put the CUDA library directory on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let stream = dev.stream().clone();
        let blas = CudaBlas::new(stream.clone()).map_err(blas_err("creating the cuBLAS handle"))?;
        let lt = CudaBlasLT::new(stream.clone()).map_err(|e| CudaError::Blas {
            context: "creating the cuBLASLt handle".into(),
            status: format!("{:?}", e.0),
        })?;
        // 32 MiB, the size NVIDIA recommends for Hopper and later (4 MiB before).
        let (major, _) = dev.arch();
        let bytes = if major >= 9 { 32 << 20 } else { 4 << 20 };
        let mut workspace = dev.alloc::<u8>(bytes)?;
        {
            let (ptr, _guard) = workspace.device_ptr_mut(&stream);
            // SAFETY: the buffer lives as long as the handle (both are fields of `Self`) and is only used on its stream.
            let status = unsafe { cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, bytes) };
            if status != cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(CudaError::Blas {
                    context: "setting the cuBLAS workspace".into(),
                    status: format!("{status:?}"),
                });
            }
        }
        Ok(Self {
            blas,
            lt,
            stream,
            _workspace: workspace,
        })
    }

    /// `out[rows, out_dim] = x[rows, in_dim] · w[out_dim, in_dim]ᵀ` through `cublasGemmEx`: bf16 operands, f32
    /// accumulation, output stored as `O` (f32 or bf16).
    pub fn linear<O: Elem>(
        &self,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<O>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()> {
        const OP: &str = "linear";
        check_linear(OP, [x.len(), w.len(), out.len()], rows, in_dim, out_dim)?;
        let (r, k, n) = dims_i32(OP, rows, in_dim, out_dim)?;
        if rows == 0 || out_dim == 0 {
            return Ok(());
        }
        ensure(OP, in_dim > 0, || "in_dim is 0".into())?;
        let out_type = match O::NAME {
            "f32" => cublas::sys::cudaDataType_t::CUDA_R_32F,
            _ => cublas::sys::cudaDataType_t::CUDA_R_16BF,
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        // SAFETY: lengths were checked against the dimensions; the pointers live on the handle's stream.
        unsafe {
            cublas::result::gemm_ex(
                *self.blas.handle(),
                cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                r,
                k,
                (&alpha as *const f32).cast(),
                wp as *const _,
                cublas::sys::cudaDataType_t::CUDA_R_16BF,
                k,
                xp as *const _,
                cublas::sys::cudaDataType_t::CUDA_R_16BF,
                k,
                (&beta as *const f32).cast(),
                op as *mut _,
                out_type,
                n,
                cublas::sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("cublasGemmEx (linear)"))
    }

    /// `out[rows, out_dim] = x[rows, in_dim] · w[out_dim, in_dim]ᵀ` all in f32 (`CUBLAS_COMPUTE_32F`, no TF32): for the
    /// small GEMMs whose outputs make discrete decisions (MoE routers).
    pub fn linear_f32<O: Elem>(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<O>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()> {
        const OP: &str = "linear_f32";
        ensure(OP, O::NAME == "f32", || {
            format!("output stored as {}, expected f32", O::NAME)
        })?;
        check_linear(OP, [x.len(), w.len(), out.len()], rows, in_dim, out_dim)?;
        let (r, k, n) = dims_i32(OP, rows, in_dim, out_dim)?;
        if rows == 0 || out_dim == 0 {
            return Ok(());
        }
        ensure(OP, in_dim > 0, || "in_dim is 0".into())?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let f32_t = cublas::sys::cudaDataType_t::CUDA_R_32F;
        // SAFETY: lengths were checked against the dimensions; the pointers live on the handle's stream.
        unsafe {
            cublas::result::gemm_ex(
                *self.blas.handle(),
                cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                r,
                k,
                (&alpha as *const f32).cast(),
                wp as *const _,
                f32_t,
                k,
                xp as *const _,
                f32_t,
                k,
                (&beta as *const f32).cast(),
                op as *mut _,
                f32_t,
                n,
                cublas::sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
                cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("cublasGemmEx (linear_f32)"))
    }

    /// `out = x · wᵀ (+ bias)` through cuBLASLt with bf16 operands and output, f32 accumulation; the bias
    /// (`[out_dim]`) is added in the GEMM's epilogue.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_lt(
        &self,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        bias: Option<&CudaSlice<bf16>>,
        out: &mut CudaSlice<bf16>,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) -> Result<()> {
        const OP: &str = "linear_lt";
        check_linear(OP, [x.len(), w.len(), out.len()], rows, in_dim, out_dim)?;
        if let Some(b) = bias {
            check_len(OP, "bias", b.len(), out_dim)?;
        }
        dims_i32(OP, rows, in_dim, out_dim)?;
        if rows == 0 || out_dim == 0 {
            return Ok(());
        }
        ensure(OP, in_dim > 0, || "in_dim is 0".into())?;
        let cfg = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: out_dim as u64,
            n: rows as u64,
            k: in_dim as u64,
            alpha: 1.0,
            lda: in_dim as i64,
            ldb: in_dim as i64,
            beta: 0.0,
            ldc: out_dim as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        // SAFETY: lengths were checked against the dimensions.
        unsafe { self.lt.matmul(cfg, w, x, out, bias, None) }.map_err(|e| CudaError::Blas {
            context: "cublasLtMatmul (linear_lt)".into(),
            status: format!("{:?}", e.0),
        })
    }
}
