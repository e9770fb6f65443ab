//! CUDA cubin members (project addition to SPEC-v1 §8): every `*.cubin` in the
//! package entry must be a CUDA ELF built for the artifact's `sm`.
//!
//! A cubin is an ELF64 little-endian file with `e_machine` 190 (EM_CUDA). Its
//! SM number sits in `e_flags`: in the low byte up to ELF ABI version 7
//! (sm_90 from CUDA 12 writes `0x5a055a`), in bits 8–15 from ABI version 8 on
//! (sm_90 from CUDA 13 writes `0x9005a04`, read off real packages minted on an
//! H200; sm_100 writes `0x6006402`). The ABI version is `e_ident[EI_ABIVERSION]`. The
//! architecture-specific `a` targets (`sm_90a`) are compared by SM number only.

use super::elf::parse_elf;
use crate::{Code, Error, Result};

/// `e_machine` of CUDA device code.
pub const EM_CUDA: u16 = 190;

fn invalid(member: &str, why: impl std::fmt::Display) -> Error {
    Error::new(
        Code::ArtifactCubinInvalid,
        format!("cannot verify AOTInductor package: {member}: {why}"),
    )
}

/// The SM number a cubin is built for (for example 90), after the bounded
/// ELF checks of SPEC-v1 §8.6.
pub fn cubin_sm(member: &str, bytes: &[u8]) -> Result<u32> {
    let info = parse_elf(bytes).map_err(|e| invalid(member, e.message()))?;
    if info.machine != EM_CUDA {
        return Err(invalid(
            member,
            format_args!("e_machine is {}, not {EM_CUDA} (CUDA)", info.machine),
        ));
    }
    let e_flags = info.flags;
    let abi_version = bytes[goblin::elf::header::EI_ABIVERSION];
    Ok(if abi_version >= 8 {
        (e_flags >> 8) & 0xff
    } else {
        e_flags & 0xff
    })
}

/// The SM number of an `sm` axis value: `sm_90` and `sm_90a` give 90; CPU
/// values (`cpu-…`) give `None`.
pub fn sm_number(sm: &str) -> Option<u32> {
    let digits = sm.strip_prefix("sm_")?;
    let digits = digits.strip_suffix('a').unwrap_or(digits);
    digits.parse().ok()
}

/// Check one cubin member against the artifact's `sm`.
pub fn check_cubin(member: &str, bytes: &[u8], sm: &str) -> Result<()> {
    let found = cubin_sm(member, bytes)?;
    match sm_number(sm) {
        Some(want) if want == found => Ok(()),
        Some(_) => Err(Error::new(
            Code::ArtifactCubinArchMismatch,
            format!("cannot verify AOTInductor package: {member} is built for sm_{found}, the artifact is for {sm}"),
        )),
        None => Err(Error::new(
            Code::ArtifactCubinArchMismatch,
            format!("cannot verify AOTInductor package: {member} is CUDA code (sm_{found}) in an artifact for {sm}"),
        )),
    }
}

/// A minimal cubin for tests: a valid ELF64 with `e_machine` EM_CUDA and the
/// given ABI version and `e_flags`.
pub fn synthetic_cubin(abi_version: u8, e_flags: u32) -> Vec<u8> {
    let mut b = super::elf::synthetic_elf(EM_CUDA, 0);
    b[8] = abi_version;
    b[0x30..0x34].copy_from_slice(&e_flags.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sm_numbers_of_both_flag_layouts() {
        assert_eq!(
            cubin_sm("k.cubin", &synthetic_cubin(7, 0x5a055a)).unwrap(),
            90
        );
        assert_eq!(
            cubin_sm("k.cubin", &synthetic_cubin(7, 0x460546)).unwrap(),
            70
        );
        assert_eq!(
            cubin_sm("k.cubin", &synthetic_cubin(8, 0x6006402)).unwrap(),
            100
        );
        assert_eq!(
            cubin_sm("k.cubin", &synthetic_cubin(8, 0x6007802)).unwrap(),
            120
        );
    }

    #[test]
    fn sm_axis_values() {
        assert_eq!(sm_number("sm_90"), Some(90));
        assert_eq!(sm_number("sm_90a"), Some(90));
        assert_eq!(sm_number("sm_120"), Some(120));
        assert_eq!(sm_number("cpu-x86-64-v3"), None);
        assert_eq!(sm_number("sm_x"), None);
    }

    #[test]
    fn refusals_are_named() {
        let host = super::super::elf::synthetic_elf(62, 16);
        assert_eq!(
            check_cubin("k.cubin", &host, "sm_90").unwrap_err().code(),
            Code::ArtifactCubinInvalid
        );
        assert_eq!(
            check_cubin("k.cubin", b"\x7fELF", "sm_90")
                .unwrap_err()
                .code(),
            Code::ArtifactCubinInvalid
        );
        let sm80 = synthetic_cubin(7, 0x500550);
        let err = check_cubin("k.cubin", &sm80, "sm_90").unwrap_err();
        assert_eq!(err.code(), Code::ArtifactCubinArchMismatch);
        assert!(err.message().contains("sm_80") && err.message().contains("sm_90"));
        assert_eq!(
            check_cubin("k.cubin", &sm80, "cpu-x86-64-v3")
                .unwrap_err()
                .code(),
            Code::ArtifactCubinArchMismatch
        );
        check_cubin("k.cubin", &synthetic_cubin(7, 0x5a055a), "sm_90a").unwrap();
    }
}
