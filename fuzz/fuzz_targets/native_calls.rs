//! The scan for calls the native path cannot make (proxy-executor calls,
//! non-aten dispatcher calls) over arbitrary text, with an arbitrary
//! extern-kernel table: it never panics, every counted site is an
//! occurrence of its function's name, and its work is linear in the text
//! (a super-linear input is a crash here, not a slow run).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcg_core::artifact::package::native_calls::{native_calls_scan_work, scan_native_calls};

fuzz_target!(|data: &[u8]| {
    // The first bytes up to a NUL are the extern-kernel table, the rest the wrapper.
    let (table, text) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&data[..0], data),
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    for call in scan_native_calls(text, Some(table)) {
        let sites = text.matches(call.call.as_str()).count() as u64;
        assert!(call.count >= 1 && call.count <= sites, "{call:?}");
    }
    let work = native_calls_scan_work(text);
    assert!(
        work <= 24 * text.len() as u64 + 1024,
        "scan work {work} for {} bytes",
        text.len()
    );
});
