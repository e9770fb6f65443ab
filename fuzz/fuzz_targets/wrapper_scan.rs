//! The package verifier over an arbitrary `model.pt2`: the zip bounds, the
//! wrapper scan, the ELF and loader checks. When the package has a wrapper
//! within its size bound, the scan of it must take work linear in its length
//! (a super-linear input is a crash here, not a slow run).
#![no_main]

use std::io::Write;

use libfuzzer_sys::fuzz_target;
use tcg_core::artifact::package::wrapper::wrapper_scan_work;
use tcg_core::artifact::package::{verify_package_facts, Package};
use tcg_core::artifact::MAX_WRAPPER_BYTES;

/// Work allowed per byte of wrapper (the scan examines each byte a bounded
/// number of times per assignment form).
const WORK_PER_BYTE: u64 = 32;

fuzz_target!(|data: &[u8]| {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(data).unwrap();
    let path = file.path();
    let _ = verify_package_facts(path, "denoiser/h=64,w=64", &[], "x86_64", "cpu-x86-64-v3");
    let Ok(mut pkg) = Package::open(path) else {
        return;
    };
    let Ok(members) = pkg.entry_members(None) else {
        return;
    };
    let Ok(bytes) = pkg.read_bounded(&members.wrapper, MAX_WRAPPER_BYTES) else {
        return;
    };
    if let Ok(text) = std::str::from_utf8(&bytes) {
        let work = wrapper_scan_work(text);
        assert!(
            work <= WORK_PER_BYTE * text.len() as u64 + 4096,
            "scan work {work} for {} bytes",
            text.len()
        );
    }
});
