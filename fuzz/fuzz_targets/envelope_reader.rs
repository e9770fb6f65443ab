//! The strict envelope reader over arbitrary bytes: it must refuse with an
//! `ArtifactError` (or accept) and never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcg_core::artifact::{read_envelope, Metadata};
use tcg_core::Kind;

fuzz_target!(|data: &[u8]| {
    let stage = tempfile::tempdir().unwrap();
    let mut admit = |_: &Metadata| Ok(());
    if let Err(e) = read_envelope(data, stage.path(), &mut admit) {
        assert_eq!(e.kind(), Kind::Artifact, "{e}");
    }
});
