//! `load_native`'s scan of the generated `check_input_<i>` functions over
//! arbitrary text: it refuses or reads facts, with work linear in the text
//! (a super-linear input is a crash here, not a slow run).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcg_run::inputs::{input_facts, input_scan_work};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(Some(facts)) = input_facts(text) {
        for f in &facts {
            assert!(f.dims.len() <= 65, "rank {}", f.dims.len());
        }
    }
    let work = input_scan_work(text);
    assert!(
        work <= 8 * text.len() as u64 + 64,
        "scan work {work} for {} bytes",
        text.len()
    );
});
