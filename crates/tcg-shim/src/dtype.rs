//! Scalar types and device types, numbered as c10 numbers them.
//!
//! shim.h hides these numbers behind functions (`aoti_torch_dtype_float32()`
//! and so on), but the generated code passes the returned values back to us
//! unchanged, so our numbering only has to agree with itself. We use c10's
//! numbers anyway (`c10::ScalarType`, `c10::DeviceType`) so that a value
//! logged by either runtime means the same thing.

use crate::error::ShimError;

/// A scalar type the shim can hold, with c10's `ScalarType` number as its
/// discriminant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DType {
    /// `uint8` (c10 `Byte`).
    UInt8 = 0,
    /// `int8` (c10 `Char`).
    Int8 = 1,
    /// `int16` (c10 `Short`).
    Int16 = 2,
    /// `int32` (c10 `Int`).
    Int32 = 3,
    /// `int64` (c10 `Long`).
    Int64 = 4,
    /// IEEE half precision.
    Float16 = 5,
    /// IEEE single precision.
    Float32 = 6,
    /// IEEE double precision.
    Float64 = 7,
    /// Complex of two halves (c10 `ComplexHalf`).
    Complex32 = 8,
    /// Complex of two floats.
    Complex64 = 9,
    /// Complex of two doubles.
    Complex128 = 10,
    /// One byte per boolean.
    Bool = 11,
    /// bfloat16.
    BFloat16 = 15,
    /// float8 e5m2.
    Float8E5M2 = 23,
    /// float8 e4m3fn.
    Float8E4M3Fn = 24,
    /// float8 e5m2fnuz.
    Float8E5M2Fnuz = 25,
    /// float8 e4m3fnuz.
    Float8E4M3Fnuz = 26,
    /// `uint16`.
    UInt16 = 27,
    /// `uint32`.
    UInt32 = 28,
    /// `uint64`.
    UInt64 = 29,
    /// float8 e8m0fnu (an exponent-only scale type).
    Float8E8M0Fnu = 44,
    /// Two float4 e2m1fn values packed into one byte.
    Float4E2M1FnX2 = 45,
}

impl DType {
    /// Every dtype that shim.h has a constant for, in c10 order.
    pub const ALL: [DType; 22] = [
        DType::UInt8,
        DType::Int8,
        DType::Int16,
        DType::Int32,
        DType::Int64,
        DType::Float16,
        DType::Float32,
        DType::Float64,
        DType::Complex32,
        DType::Complex64,
        DType::Complex128,
        DType::Bool,
        DType::BFloat16,
        DType::Float8E5M2,
        DType::Float8E4M3Fn,
        DType::Float8E5M2Fnuz,
        DType::Float8E4M3Fnuz,
        DType::UInt16,
        DType::UInt32,
        DType::UInt64,
        DType::Float8E8M0Fnu,
        DType::Float4E2M1FnX2,
    ];

    /// The c10 `ScalarType` number.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The dtype with c10 number `code`, or `shim.unsupported_dtype`.
    pub fn from_code(code: i32) -> Result<DType, ShimError> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.code() == code)
            .ok_or(ShimError::UnsupportedDtype { code })
    }

    /// Bytes per element (the packed float4 pair is one byte, as in c10).
    pub fn element_size(self) -> usize {
        match self {
            DType::UInt8
            | DType::Int8
            | DType::Bool
            | DType::Float8E5M2
            | DType::Float8E4M3Fn
            | DType::Float8E5M2Fnuz
            | DType::Float8E4M3Fnuz
            | DType::Float8E8M0Fnu
            | DType::Float4E2M1FnX2 => 1,
            DType::Int16 | DType::Float16 | DType::BFloat16 | DType::UInt16 => 2,
            DType::Int32 | DType::Float32 | DType::UInt32 | DType::Complex32 => 4,
            DType::Int64 | DType::Float64 | DType::UInt64 | DType::Complex64 => 8,
            DType::Complex128 => 16,
        }
    }
}

/// A device type the shim accepts, with c10's `DeviceType` number as its
/// discriminant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DeviceType {
    /// Host memory.
    Cpu = 0,
    /// An NVIDIA GPU.
    Cuda = 1,
}

impl DeviceType {
    /// The c10 `DeviceType` number.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The device type with c10 number `code`; any other number is refused.
    pub fn from_code(code: i32) -> Result<DeviceType, ShimError> {
        match code {
            0 => Ok(DeviceType::Cpu),
            1 => Ok(DeviceType::Cuda),
            _ => Err(ShimError::UnsupportedDevice {
                device_type: code,
                device_index: 0,
                reason: "unknown device type",
            }),
        }
    }
}

/// A device: its type and index (`-1` means "the current one", as in c10).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    /// Host or GPU.
    pub device_type: DeviceType,
    /// Index among devices of that type; `-1` for the current or unspecified one.
    pub index: i32,
}

impl Device {
    /// The host.
    pub const CPU: Device = Device {
        device_type: DeviceType::Cpu,
        index: -1,
    };

    /// Validates a (type, index) pair from the C ABI.
    pub fn from_codes(device_type: i32, device_index: i32) -> Result<Device, ShimError> {
        let kind =
            DeviceType::from_code(device_type).map_err(|_| ShimError::UnsupportedDevice {
                device_type,
                device_index,
                reason: "unknown device type",
            })?;
        if device_index < -1 {
            return Err(ShimError::UnsupportedDevice {
                device_type,
                device_index,
                reason: "negative device index",
            });
        }
        Ok(Device {
            device_type: kind,
            index: device_index,
        })
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.device_type {
            DeviceType::Cpu => "cpu",
            DeviceType::Cuda => "cuda",
        };
        write!(f, "{name}:{}", self.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_refused() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()).unwrap(), d);
        }
        for bad in [-1, 12, 13, 14, 16, 22, 30, 43, 46, 1000] {
            let err = DType::from_code(bad).unwrap_err();
            assert_eq!(err.code(), "shim.unsupported_dtype");
        }
    }

    #[test]
    fn device_index_below_minus_one_is_refused() {
        assert!(Device::from_codes(0, -1).is_ok());
        assert!(Device::from_codes(1, 3).is_ok());
        assert_eq!(
            Device::from_codes(1, -2).unwrap_err().code(),
            "shim.unsupported_device"
        );
        assert_eq!(
            Device::from_codes(14, 0).unwrap_err().code(),
            "shim.unsupported_device"
        );
    }
}
