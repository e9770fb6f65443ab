//! Priming cuBLAS beside a load. A graph's first call pays for initialising
//! the GPU libraries it calls into; on an H200 about half of a transformer's
//! first call (~0.1 s) was cuBLASLt's one-time set-up (its handle, loading
//! its kernel library, its first heuristic query). [`prime`] makes one tiny
//! matrix product of the graph's dtype through the same shim entry point the
//! graph calls, on a helper thread while the load creates the container and
//! waits for its weights; what it initialises is process-wide, so the first
//! call finds it done. Nothing it computes is read; a failure only means the
//! first call pays as before.

use std::sync::Arc;

use tcg_core::artifact::metadata::ConstantRow;

use crate::cuda::Device;
use crate::torch::{Dtype, OwnedTensor, Torch};

/// Which cuBLAS entry point a graph calls (from its wrapper's source:
/// `addmm` when it calls `aoti_torch_cuda_addmm_out`, else `mm`), and in
/// which dtype: that of its largest matrix constant, when a float one.
pub(crate) fn plan<'r>(wrapper: &str, rows: &'r [ConstantRow]) -> Option<(bool, &'r str)> {
    let bias = wrapper.contains("aoti_torch_cuda_addmm_out(");
    if !bias && !wrapper.contains("aoti_torch_cuda_mm_out(") {
        return None;
    }
    let largest = rows
        .iter()
        .filter(|r| r.shape.len() == 2)
        .max_by_key(|r| r.shape.iter().product::<u64>())?;
    matches!(largest.dtype.as_str(), "bfloat16" | "float16" | "float32")
        .then_some((bias, largest.dtype.as_str()))
}

/// One `[16, 64] x [64, 64]` product (`+ bias[64]` when `bias`) of `dtype`
/// on `cuda:index`, through the shim. Returns whether it ran.
pub(crate) fn prime(torch: &Arc<Torch>, index: i32, bias: bool, dtype: Dtype) -> bool {
    let Ok(cuda) = torch.cuda() else {
        return false;
    };
    let device = Device::Cuda(index);
    let made = (|| -> tcg_core::Result<bool> {
        let out = OwnedTensor::empty(torch, &[16, 64], dtype, device, 0)?;
        let a = OwnedTensor::empty(torch, &[16, 64], dtype, device, 0)?;
        let b = OwnedTensor::empty(torch, &[64, 64], dtype, device, 0)?;
        let _guard = cuda.device_guard(index)?;
        let rc = if bias {
            let Some(addmm) = cuda.addmm_out else {
                return Ok(false);
            };
            let c = OwnedTensor::empty(torch, &[64], dtype, device, 0)?;
            // SAFETY: four live tensors of `device`, shapes that multiply;
            // the shim catches what the operator throws and returns a code.
            unsafe { addmm(out.handle(), c.handle(), a.handle(), b.handle(), 1.0, 1.0) }
        } else {
            let Some(mm) = cuda.mm_out else {
                return Ok(false);
            };
            // SAFETY: as above.
            unsafe { mm(out.handle(), a.handle(), b.handle()) }
        };
        Ok(rc == 0)
    })();
    matches!(made, Ok(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tcg_core::artifact::metadata::ConstantSource;

    fn row(fqn: &str, dtype: &str, shape: &[u64]) -> ConstantRow {
        ConstantRow {
            fqn: fqn.into(),
            source: ConstantSource::StateDict,
            dtype: dtype.into(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn the_entry_point_and_dtype_come_from_the_wrapper_and_the_largest_matrix() {
        let rows = [
            row("norm.weight", "float32", &[4096]),
            row("fc.weight", "bfloat16", &[4096, 1024]),
            row("proj.weight", "float32", &[64, 64]),
        ];
        let addmm =
            "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cuda_addmm_out(buf1, b, a, w, 1L, 1L));";
        let mm = "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cuda_mm_out(buf1, a, w));";
        assert_eq!(plan(addmm, &rows), Some((true, "bfloat16")));
        assert_eq!(plan(mm, &rows), Some((false, "bfloat16")));
        // No cuBLAS call, no matrix, or an integer matrix: nothing to prime.
        assert_eq!(plan("triton_poi_fused_0(...)", &rows), None);
        assert_eq!(plan(addmm, &rows[..1]), None);
        assert_eq!(plan(addmm, &[row("table", "int8", &[10, 10])]), None);
    }
}
