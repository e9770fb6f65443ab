//! metadata.json validation over arbitrary bytes; accepted bytes are
//! canonical and re-validate identically.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcg_core::artifact::validate_metadata;

fuzz_target!(|data: &[u8]| {
    if let Ok(md) = validate_metadata(data, None) {
        assert_eq!(md.bytes(), data);
        assert_eq!(validate_metadata(md.bytes(), None).unwrap().key(), md.key());
    }
});
