//! DLPack, the C ABI array libraries exchange tensors by (dlpack.h, version
//! 1.x; the legacy unversioned struct too), for inputs from any framework and
//! zero-copy outputs to any framework.
//!
//! The structs are declared here rather than taken from a crate: they are a
//! fixed C layout of a few fields, and the crates that provide them bring a
//! Python binding layer of their own.

use std::ffi::c_void;
use std::sync::Arc;

use tcg_core::{Code, Error, Result};

use crate::cuda::Device;
use crate::graph::Input;
use crate::torch::{contiguous_strides, OwnedTensor};

/// `DLDevice`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDevice {
    /// `DLDeviceType` (1 CPU, 2 CUDA, 3 CUDA host, ...).
    pub device_type: i32,
    /// The device index.
    pub device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDataType {
    /// `DLDataTypeCode` (0 int, 1 uint, 2 float, 4 bfloat, 6 bool).
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes (1 for a scalar type).
    pub lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// The data pointer (an opaque handle on some devices; an address on CPU and CUDA).
    pub data: *mut c_void,
    /// Where the data is.
    pub device: DLDevice,
    /// The number of dimensions.
    pub ndim: i32,
    /// The element type.
    pub dtype: DLDataType,
    /// `ndim` sizes.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or null for C-contiguous.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor` (the legacy, unversioned capsule `"dltensor"`).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called by the consumer when done.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLPackVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

/// `DLManagedTensorVersioned` (the capsule `"dltensor_versioned"`).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The version the producer implements.
    pub version: DLPackVersion,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called by the consumer when done.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `DLPACK_FLAG_BITMASK_*`.
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}

/// The DLPack version these outputs are exported as.
pub const VERSION: DLPackVersion = DLPackVersion { major: 1, minor: 1 };
/// `kDLCPU`.
pub const DEVICE_CPU: i32 = 1;
/// `kDLCUDA`.
pub const DEVICE_CUDA: i32 = 2;
/// `kDLCUDAHost` (pinned host memory: readable by the CPU like any host memory).
pub const DEVICE_CUDA_HOST: i32 = 3;

/// The DLPack type of inductor's dtype name.
pub fn dl_dtype(name: &str) -> Option<DLDataType> {
    let (code, bits) = match name {
        "int8" => (0, 8),
        "int16" => (0, 16),
        "int32" => (0, 32),
        "int64" => (0, 64),
        "uint8" => (1, 8),
        "float16" => (2, 16),
        "float32" => (2, 32),
        "float64" => (2, 64),
        "bfloat16" => (4, 16),
        "bool" => (6, 8),
        _ => return None,
    };
    Some(DLDataType {
        code,
        bits,
        lanes: 1,
    })
}

fn dtype_name(t: DLDataType) -> Option<&'static str> {
    if t.lanes != 1 {
        return None;
    }
    Some(match (t.code, t.bits) {
        (0, 8) => "int8",
        (0, 16) => "int16",
        (0, 32) => "int32",
        (0, 64) => "int64",
        (1, 8) => "uint8",
        (2, 16) => "float16",
        (2, 32) => "float32",
        (2, 64) => "float64",
        (4, 16) => "bfloat16",
        (6, 8) => "bool",
        _ => return None,
    })
}

/// The `DLDevice` of a device.
pub fn dl_device(device: Device) -> DLDevice {
    match device {
        Device::Cpu => DLDevice {
            device_type: DEVICE_CPU,
            device_id: 0,
        },
        Device::Cuda(i) => DLDevice {
            device_type: DEVICE_CUDA,
            device_id: i,
        },
    }
}

enum Owner {
    Legacy(*mut DLManagedTensor),
    Versioned(*mut DLManagedTensorVersioned),
}

/// A tensor another library exported, described as a graph input; the
/// producer's deleter runs when this value drops.
pub struct Imported {
    owner: Owner,
    input: Input,
}

// SAFETY: the managed tensor is only read, and the deleter is called once;
// DLPack producers' deleters may be called from any thread (those of Python
// libraries take the interpreter lock themselves).
unsafe impl Send for Imported {}
// SAFETY: nothing is mutated after construction; the deleter runs in `Drop` only.
unsafe impl Sync for Imported {}

impl std::fmt::Debug for Imported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Imported")
            .field("input", &self.input)
            .finish()
    }
}

impl Imported {
    /// Take ownership of a legacy managed tensor and check it.
    ///
    /// # Safety
    /// `ptr` must be a live `DLManagedTensor` whose ownership passes here (the
    /// capsule was consumed); its deleter runs when the result, or the error
    /// path, drops it.
    pub unsafe fn from_legacy(ptr: *mut DLManagedTensor) -> Result<Imported> {
        if ptr.is_null() {
            return Err(layout("a DLPack capsule holds no tensor".into()));
        }
        // SAFETY: live per the caller's contract.
        let t = unsafe { &(*ptr).dl_tensor };
        let owner = Owner::Legacy(ptr);
        // SAFETY: the tensor's fields are valid as long as `owner` lives.
        unsafe { Imported::describe(owner, t) }
    }

    /// Take ownership of a versioned managed tensor and check it.
    ///
    /// # Safety
    /// As [`Imported::from_legacy`].
    pub unsafe fn from_versioned(ptr: *mut DLManagedTensorVersioned) -> Result<Imported> {
        if ptr.is_null() {
            return Err(layout("a DLPack capsule holds no tensor".into()));
        }
        // SAFETY: live per the caller's contract.
        let (version, t) = unsafe { ((*ptr).version, &(*ptr).dl_tensor) };
        let owner = Owner::Versioned(ptr);
        if version.major != 1 {
            drop(Imported {
                owner,
                input: empty_input(),
            });
            return Err(layout(format!(
                "a DLPack tensor of version {}.{} (this reads version 1)",
                version.major, version.minor
            )));
        }
        // SAFETY: the tensor's fields are valid as long as `owner` lives.
        unsafe { Imported::describe(owner, t) }
    }

    /// # Safety
    /// `t` belongs to `owner` and is valid while it lives.
    unsafe fn describe(owner: Owner, t: &DLTensor) -> Result<Imported> {
        // From here on `guard` owns the producer's tensor, so every early
        // return releases it.
        let mut guard = Imported {
            owner,
            input: empty_input(),
        };
        if !(0..=64).contains(&t.ndim) || (t.ndim > 0 && t.shape.is_null()) {
            return Err(layout(format!("a DLPack tensor of rank {}", t.ndim)));
        }
        let rank = t.ndim as usize;
        let shape: Vec<i64> = if rank == 0 {
            Vec::new()
        } else {
            // SAFETY: `ndim` int64s (DLPack's contract), checked non-null above.
            unsafe { std::slice::from_raw_parts(t.shape, rank) }.to_vec()
        };
        if shape.iter().any(|&d| d < 0) {
            return Err(layout(format!("a DLPack tensor of shape {shape:?}")));
        }
        let dtype = dtype_name(t.dtype).ok_or_else(|| {
            Error::new(
                Code::RunInputMismatch,
                format!(
                    "a DLPack tensor of type code {} bits {} lanes {}, which the graph cannot take",
                    t.dtype.code, t.dtype.bits, t.dtype.lanes
                ),
            )
        })?;
        let device = match t.device.device_type {
            DEVICE_CPU | DEVICE_CUDA_HOST => Device::Cpu,
            DEVICE_CUDA => Device::Cuda(t.device.device_id),
            other => {
                return Err(Error::new(
                    Code::RunDeviceMismatch,
                    format!(
                    "a DLPack tensor on device type {other}, which the native path does not run on"
                ),
                ))
            }
        };
        let size = usize::from(t.dtype.bits / 8);
        let numel = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d as usize))
            .ok_or_else(|| layout(format!("a DLPack tensor of shape {shape:?} is too large")))?;
        if !t.strides.is_null() && numel > 0 {
            // SAFETY: `ndim` int64s when non-null (DLPack's contract).
            let strides = unsafe { std::slice::from_raw_parts(t.strides, rank) };
            let want = contiguous_strides(&shape);
            // A dimension of size 1 may carry any stride: it is never stepped.
            let contiguous = shape
                .iter()
                .zip(strides.iter().zip(&want))
                .all(|(&d, (s, w))| d == 1 || s == w);
            if !contiguous {
                return Err(layout(format!(
                    "a DLPack tensor of shape {shape:?} is not C-contiguous (strides {strides:?})"
                )));
            }
        }
        let data = (t.data as usize)
            .checked_add(usize::try_from(t.byte_offset).unwrap_or(usize::MAX))
            .ok_or_else(|| layout("a DLPack tensor's address overflows".into()))?;
        if data % size != 0 {
            return Err(layout(format!(
                "a DLPack tensor is not aligned to its {size}-byte elements"
            )));
        }
        // Checked like every size computed from a producer's shape: an
        // overflow is a refusal, never a panic or a wrapped length.
        let nbytes = numel
            .checked_mul(size)
            .filter(|&n| isize::try_from(n).is_ok())
            .ok_or_else(|| layout(format!("a DLPack tensor of shape {shape:?} is too large")))?;
        guard.input = Input {
            data,
            nbytes,
            dtype: dtype.to_owned(),
            shape,
            device,
        };
        Ok(guard)
    }

    /// The tensor as a graph input (valid while this value lives).
    pub fn input(&self) -> &Input {
        &self.input
    }
}

fn empty_input() -> Input {
    Input {
        data: 0,
        nbytes: 0,
        dtype: String::new(),
        shape: Vec::new(),
        device: Device::Cpu,
    }
}

fn layout(message: String) -> Error {
    Error::new(Code::RunInputLayout, message)
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: this value owns the managed tensor and calls its deleter
        // exactly once, as DLPack requires of the consumer.
        unsafe {
            match self.owner {
                Owner::Legacy(p) => {
                    if let Some(d) = (*p).deleter {
                        d(p)
                    }
                }
                Owner::Versioned(p) => {
                    if let Some(d) = (*p).deleter {
                        d(p)
                    }
                }
            }
        }
    }
}

/// What an exported tensor keeps alive: the output and its shape arrays.
struct Context {
    _tensor: Arc<OwnedTensor>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

fn dl_tensor(tensor: &OwnedTensor, ctx: &mut Context) -> DLTensor {
    DLTensor {
        data: tensor.data_ptr() as *mut c_void,
        device: dl_device(tensor.device()),
        ndim: ctx.shape.len() as i32,
        dtype: dl_dtype(tensor.dtype().name)
            .expect("every dtype of the native path has a DLPack type"),
        shape: ctx.shape.as_mut_ptr(),
        strides: ctx.strides.as_mut_ptr(),
        byte_offset: 0,
    }
}

fn context(tensor: &Arc<OwnedTensor>) -> Box<Context> {
    Box::new(Context {
        _tensor: Arc::clone(tensor),
        shape: tensor.sizes().to_vec(),
        strides: tensor.strides().to_vec(),
    })
}

unsafe extern "C" fn delete_legacy(p: *mut DLManagedTensor) {
    // SAFETY: `p` and its context were made by `export` from boxes and are
    // freed exactly once, here (DLPack calls the deleter once).
    unsafe {
        let m = Box::from_raw(p);
        drop(Box::from_raw(m.manager_ctx.cast::<Context>()));
    }
}

unsafe extern "C" fn delete_versioned(p: *mut DLManagedTensorVersioned) {
    // SAFETY: as `delete_legacy`, for `export_versioned`.
    unsafe {
        let m = Box::from_raw(p);
        drop(Box::from_raw(m.manager_ctx.cast::<Context>()));
    }
}

/// Export `tensor` without a copy as a legacy `DLManagedTensor`; the memory
/// stays alive until the consumer calls the deleter.
pub fn export(tensor: &Arc<OwnedTensor>) -> *mut DLManagedTensor {
    let mut ctx = context(tensor);
    let dl = dl_tensor(tensor, &mut ctx);
    Box::into_raw(Box::new(DLManagedTensor {
        dl_tensor: dl,
        manager_ctx: Box::into_raw(ctx).cast(),
        deleter: Some(delete_legacy),
    }))
}

/// Export `tensor` without a copy as a `DLManagedTensorVersioned` (writable).
pub fn export_versioned(tensor: &Arc<OwnedTensor>) -> *mut DLManagedTensorVersioned {
    let mut ctx = context(tensor);
    let dl = dl_tensor(tensor, &mut ctx);
    Box::into_raw(Box::new(DLManagedTensorVersioned {
        version: VERSION,
        manager_ctx: Box::into_raw(ctx).cast(),
        deleter: Some(delete_versioned),
        flags: 0,
        dl_tensor: dl,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_its_dlpack_type() {
        for (name, size) in crate::torch::DTYPES {
            let t = dl_dtype(name).unwrap();
            assert_eq!(dtype_name(t), Some(name));
            assert_eq!(usize::from(t.bits / 8), size, "{name}");
        }
        assert_eq!(
            dtype_name(DLDataType {
                code: 2,
                bits: 32,
                lanes: 4
            }),
            None
        );
        assert_eq!(
            dtype_name(DLDataType {
                code: 5,
                bits: 64,
                lanes: 1
            }),
            None
        );
    }

    static DELETED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    unsafe extern "C" fn count(p: *mut DLManagedTensor) {
        DELETED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // SAFETY: made by `managed` below from a box.
        drop(unsafe { Box::from_raw(p) });
    }

    fn managed(
        data: &mut [f32],
        shape: &mut [i64],
        strides: Option<&mut [i64]>,
        device_type: i32,
        offset: u64,
    ) -> *mut DLManagedTensor {
        Box::into_raw(Box::new(DLManagedTensor {
            dl_tensor: DLTensor {
                data: data.as_mut_ptr().cast(),
                device: DLDevice {
                    device_type,
                    device_id: 0,
                },
                ndim: shape.len() as i32,
                dtype: dl_dtype("float32").unwrap(),
                shape: shape.as_mut_ptr(),
                strides: strides.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
                byte_offset: offset,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(count),
        }))
    }

    #[test]
    fn imports_are_checked_and_always_released() {
        let mut data = [0f32; 12];
        let before = DELETED.load(std::sync::atomic::Ordering::SeqCst);
        let mut shape = [3, 4];
        // SAFETY: a live managed tensor whose deleter frees only the box.
        let ok =
            unsafe { Imported::from_legacy(managed(&mut data, &mut shape, None, 1, 4)) }.unwrap();
        assert_eq!(ok.input().shape, vec![3, 4]);
        assert_eq!(ok.input().nbytes, 48);
        assert_eq!(ok.input().data, data.as_ptr() as usize + 4);
        assert_eq!(ok.input().device, Device::Cpu);
        drop(ok);
        // Size-1 dimensions may carry any stride; others must be C-contiguous.
        let mut shape = [1, 4];
        let mut strides = [99, 1];
        // SAFETY: as above.
        unsafe { Imported::from_legacy(managed(&mut data, &mut shape, Some(&mut strides), 1, 0)) }
            .unwrap();
        let mut shape = [4, 3];
        let mut strides = [1, 4];
        // SAFETY: as above.
        let err = unsafe {
            Imported::from_legacy(managed(&mut data, &mut shape, Some(&mut strides), 1, 0))
        }
        .unwrap_err();
        assert_eq!(err.code(), Code::RunInputLayout);
        let mut shape = [3];
        // SAFETY: as above; a misaligned offset and an unknown device are refused.
        let err = unsafe { Imported::from_legacy(managed(&mut data, &mut shape, None, 1, 2)) }
            .unwrap_err();
        assert_eq!(err.code(), Code::RunInputLayout);
        // SAFETY: as above.
        let err = unsafe { Imported::from_legacy(managed(&mut data, &mut shape, None, 7, 0)) }
            .unwrap_err();
        assert_eq!(err.code(), Code::RunDeviceMismatch);
        let mut shape = [2, 2];
        // SAFETY: as above (CUDA: described, not touched).
        let gpu =
            unsafe { Imported::from_legacy(managed(&mut data, &mut shape, None, 2, 0)) }.unwrap();
        assert_eq!(gpu.input().device, Device::Cuda(0));
        drop(gpu);
        // Shapes whose element count or byte size overflow are refused
        // (issue 25: the byte size once overflowed into a panic).
        for mut shape in [
            vec![1 << 62, 2],
            vec![i64::MAX, i64::MAX],
            vec![1 << 61, 1],
            vec![3, 1 << 40, 1 << 30],
        ] {
            // SAFETY: as above (refused before the data is touched).
            let err = unsafe { Imported::from_legacy(managed(&mut data, &mut shape, None, 1, 0)) }
                .unwrap_err();
            assert_eq!(err.code(), Code::RunInputLayout, "{shape:?}");
            assert!(err.message().contains("too large"), "{err}");
        }
        // A zero dimension makes any other size harmless: nothing to read.
        let mut shape = [0, i64::MAX];
        // SAFETY: as above.
        let empty =
            unsafe { Imported::from_legacy(managed(&mut data, &mut shape, None, 1, 0)) }.unwrap();
        assert_eq!(empty.input().nbytes, 0);
        drop(empty);
        assert_eq!(
            DELETED.load(std::sync::atomic::Ordering::SeqCst) - before,
            11
        );
    }
}
