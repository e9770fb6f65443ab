//! Bit-flipped and truncated envelopes (SPEC-v1 §13.4): the reader never
//! panics, refuses with an `ArtifactError` (or accepts an unharmed input),
//! and leaves no stage behind. The parsers of untrusted bytes never panic on
//! arbitrary input.

use proptest::prelude::*;
use tcg_core::artifact::gzip::GzipWriter;
use tcg_core::artifact::package::{elf::parse_elf, wrapper::parse_wrapper};
use tcg_core::artifact::{self, Metadata};
use tcg_core::Kind;

mod common;
use common::gunzip;

fn corpus(name: &str) -> Vec<u8> {
    std::fs::read(common::corpus(name)).unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut w = GzipWriter::new(Vec::new()).unwrap();
    w.write(bytes).unwrap();
    w.finish().unwrap()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Read `bytes` fully into a fresh stage; panics are test failures.
fn outcome(bytes: &[u8]) -> Result<(), tcg_core::Error> {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    let src = tmp.path().join("in.tar.gz");
    std::fs::write(&src, bytes).unwrap();
    let mut admit = |_: &Metadata| Ok(());
    let r = artifact::unpack(&src, &dest, &mut admit).map(|_| ());
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != "in.tar.gz" && (r.is_err() || n != "out"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    r
}

fn check(bytes: &[u8], what: &str) {
    if let Err(e) = outcome(bytes) {
        assert_eq!(e.kind(), Kind::Artifact, "{what}: {} {e}", e.code());
    }
}

#[test]
fn flipped_compressed_bytes_are_refused_as_artifact_errors() {
    let base = corpus("base-literals.tar.gz");
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    for round in 0..150 {
        let mut m = base.clone();
        for _ in 0..1 + rng.below(3) {
            let i = rng.below(m.len());
            m[i] ^= 1 << rng.below(8);
        }
        check(&m, &format!("compressed flip round {round}"));
        let cut = rng.below(base.len());
        assert!(
            outcome(&base[..cut]).is_err(),
            "truncation at {cut} accepted"
        );
    }
}

#[test]
fn flipped_tar_bytes_are_refused_as_artifact_errors() {
    let tar = gunzip(&corpus("base-literals.tar.gz"));
    // Only the members' bytes and headers, not the zero tail, are interesting.
    let live = tar.iter().rposition(|&b| b != 0).unwrap() + 1;
    let mut rng = Rng(0xfeed_face_cafe_beef);
    for round in 0..250 {
        let mut m = tar.clone();
        for _ in 0..1 + rng.below(2) {
            let i = rng.below(live);
            m[i] ^= 1 << rng.below(8);
        }
        check(&gzip(&m), &format!("tar flip round {round}"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_elf_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Err(e) = parse_elf(&bytes) {
            prop_assert_eq!(e.kind(), Kind::Artifact);
        }
    }

    #[test]
    fn the_elf_parser_never_panics_on_a_mutated_object(flips in proptest::collection::vec((0usize..400, any::<u8>()), 1..6)) {
        let mut so = artifact::package::elf::synthetic_elf(62, 64);
        for (i, b) in flips {
            let n = so.len();
            so[i % n] = b;
        }
        let _ = parse_elf(&so);
    }

    #[test]
    fn the_wrapper_parser_never_panics(text in "(AOTInductorModelBase\\(|constants_info_\\[|[0-9]|\\]|\\.|name|shape|dtype|type|=|;|\\{|\\}|\\(|\\)|,|\"|true|false| |\u{3000}|static_cast<int32_t>|torch::aot_inductor::ConstantType::|cached_torch_dtype_|x)*") {
        let _ = parse_wrapper(text.as_bytes());
    }

    #[test]
    fn the_metadata_validator_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = artifact::validate_metadata(&bytes, None);
    }
}
