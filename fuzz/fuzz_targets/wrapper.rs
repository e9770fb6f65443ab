//! The wrapper constant-table scanner over arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcg_core::artifact::package::wrapper::parse_wrapper;

fuzz_target!(|data: &[u8]| {
    if let Ok(table) = parse_wrapper(data) {
        assert_eq!(table.constants.len() as u64, table.declared_count);
    }
});
