//! Envelope writer and reader behaviour (SPEC-v1 §6): exact bytes of the
//! writer, determinism, limits, staged unpacking, the tee, the literal
//! payload writer and the constant table for mint.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tcg_core::artifact::envelope::{check_compressed_size, check_sizes, read_envelope, Tee};
use tcg_core::artifact::literals::{payload_bytes, verify_payload, LiteralTensor};
use tcg_core::artifact::{self, tar, ConstantRow, ConstantSource, Metadata, MAX_ARCHIVE_BYTES};
use tcg_core::{Code, Kind};

mod common;
use common::{corpus, gunzip, reference};

fn accept() -> impl FnMut(&Metadata) -> tcg_core::Result<()> {
    |_| Ok(())
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// Unpack the base envelope of the corpus and return its members' paths.
fn base_members(tmp: &Path) -> (PathBuf, tcg_cj::Value) {
    let dest = tmp.join("base");
    artifact::unpack(&corpus("base.tar.gz"), &dest, &mut accept()).unwrap();
    let md = tcg_cj::parse_strict(&std::fs::read(dest.join("metadata.json")).unwrap()).unwrap();
    (dest.join("model.pt2"), md)
}

#[test]
fn the_tar_header_of_the_spec_example_is_exact() {
    let h = tar::header("metadata.json", 884);
    assert_eq!(&h[..13], b"metadata.json");
    assert!(h[13..100].iter().all(|&b| b == 0));
    assert_eq!(&h[100..108], b"0000644\0");
    assert_eq!(&h[108..116], b"0000000\0");
    assert_eq!(&h[116..124], b"0000000\0");
    assert_eq!(&h[124..136], b"00000001564\0");
    assert_eq!(&h[136..148], b"00000000000\0");
    assert_eq!(&h[148..156], b"010426\0 ");
    assert_eq!(h[156], b'0');
    assert_eq!(&h[257..265], b"ustar\x0000");
    assert!(h[265..].iter().all(|&b| b == 0));
}

#[test]
fn the_writer_emits_the_fixed_gzip_header_and_record_padding() {
    let bytes = artifact::envelope::envelope_bytes(b"{}", b"pkg", None).unwrap();
    assert_eq!(
        &bytes[..10],
        &[0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0x02, 0xff]
    );
    let tar_stream = gunzip(&bytes);
    assert_eq!(tar_stream.len(), 10_240);
    let n = bytes.len();
    assert_eq!(
        u32::from_le_bytes(bytes[n - 4..].try_into().unwrap()),
        10_240
    );
    let mut crc = flate2::Crc::new();
    crc.update(&tar_stream);
    assert_eq!(
        u32::from_le_bytes(bytes[n - 8..n - 4].try_into().unwrap()),
        crc.sum()
    );
    // Header, data and padding of each member, then zeros to the record.
    assert_eq!(&tar_stream[512..514], b"{}");
    assert_eq!(&tar_stream[1024..1033], b"model.pt2");
    assert_eq!(&tar_stream[1536..1539], b"pkg");
    assert!(tar_stream[2048..].iter().all(|&b| b == 0));
}

#[test]
fn packing_is_deterministic_whatever_the_input_files_mtimes_and_modes() {
    let tmp = tempfile::tempdir().unwrap();
    let (pkg, md) = base_members(tmp.path());
    let copy = tmp.path().join("copy.pt2");
    std::fs::copy(&pkg, &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(&pkg, std::fs::Permissions::from_mode(0o755)).unwrap();
    let f = std::fs::File::options().write(true).open(&copy).unwrap();
    f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000))
        .unwrap();
    drop(f);
    let a = tmp.path().join("a.tar.gz");
    let b = tmp.path().join("b.tar.gz");
    artifact::pack(&pkg, &md, None, &a).unwrap();
    artifact::pack(&copy, &md, None, &b).unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    // And it equals the committed base, written by the same writer.
    assert_eq!(
        std::fs::read(&a).unwrap(),
        std::fs::read(corpus("base.tar.gz")).unwrap()
    );
}

#[test]
fn limits_are_checked_before_anything_is_written() {
    check_compressed_size(MAX_ARCHIVE_BYTES).unwrap();
    assert_eq!(
        check_compressed_size(MAX_ARCHIVE_BYTES + 1)
            .unwrap_err()
            .code(),
        Code::ArtifactCompressedTooLarge
    );
    let e = check_sizes(&[("metadata.json", 8_388_609)]).unwrap_err();
    assert_eq!(e.code(), Code::ArtifactMemberTooLarge);
    let e = check_sizes(&[
        ("metadata.json", 1),
        ("model.pt2", 1),
        ("constants.safetensors", 4_294_967_297),
    ])
    .unwrap_err();
    assert_eq!(e.code(), Code::ArtifactMemberTooLarge);
    check_sizes(&[
        ("metadata.json", 8_388_608),
        ("model.pt2", 8_589_934_591),
        ("constants.safetensors", 4_294_967_296),
    ])
    .unwrap();
    // The writer refuses an oversized member before writing a byte.
    let mut sink = Vec::new();
    let mut empty: &[u8] = &[];
    let big = vec![b' '; 8_388_609];
    let err = artifact::write_envelope(
        &mut sink,
        &big,
        artifact::MemberSource {
            size: 0,
            reader: &mut empty,
        },
        None,
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::ArtifactMemberTooLarge);
    assert!(sink.is_empty());
}

#[test]
fn unpack_refuses_an_existing_destination_and_leaves_it_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("dest");
    std::fs::create_dir(&dest).unwrap();
    std::fs::write(dest.join("keep"), b"mine").unwrap();
    let err = artifact::unpack(&corpus("base.tar.gz"), &dest, &mut accept()).unwrap_err();
    assert_eq!(err.code(), Code::IoDestinationOccupied);
    assert_eq!(err.kind(), Kind::Io);
    assert_eq!(names(&dest), ["keep"]);
    assert_eq!(std::fs::read(dest.join("keep")).unwrap(), b"mine");
    assert_eq!(names(tmp.path()), ["dest"]);
    // A file in the way is refused the same way.
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let err = artifact::unpack(&corpus("base.tar.gz"), &file, &mut accept()).unwrap_err();
    assert_eq!(err.code(), Code::IoDestinationOccupied);
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

#[test]
fn a_failed_unpack_leaves_no_stage_and_a_good_one_publishes_0755() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("a").join("b");
    let err = artifact::unpack(&corpus("lit-digest.tar.gz"), &dest, &mut accept()).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactLiteralDigestMismatch);
    assert!(names(&tmp.path().join("a")).is_empty());
    artifact::unpack(&corpus("base-literals.tar.gz"), &dest, &mut accept()).unwrap();
    assert_eq!(names(&tmp.path().join("a")), ["b"]);
    let mode = std::fs::metadata(&dest).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & !0o022, 0o755 & !0o022);
    assert_eq!(
        names(&dest),
        ["constants.safetensors", "metadata.json", "model.pt2"]
    );
}

#[test]
fn stage_write_failures_are_io_errors_not_artifact_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let blocker = tmp.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let err =
        artifact::unpack(&corpus("base.tar.gz"), &blocker.join("dest"), &mut accept()).unwrap_err();
    assert_eq!(err.kind(), Kind::Io);
    assert_eq!(err.code(), Code::IoError);
    assert_eq!(err.errno(), Some(libc::ENOTDIR));
}

#[test]
fn the_tee_sees_every_compressed_byte_in_one_pass() {
    let bytes = std::fs::read(reference()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut h = Sha256::new();
    let mut count = 0u64;
    let tee = Tee::new(std::fs::File::open(reference()).unwrap(), |b: &[u8]| {
        h.update(b);
        count += b.len() as u64;
        Ok(())
    });
    let report = read_envelope(tee, tmp.path(), &mut accept()).unwrap();
    assert_eq!(count, bytes.len() as u64);
    assert_eq!(report.compressed_bytes, count);
    assert_eq!(h.finalize().as_slice(), Sha256::digest(&bytes).as_slice());
    assert_eq!(names(tmp.path()), ["metadata.json", "model.pt2"]);
}

#[test]
fn pack_refuses_a_package_that_is_not_a_regular_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, md) = base_members(tmp.path());
    let out = tmp.path().join("out.tar.gz");
    let err = artifact::pack(tmp.path(), &md, None, &out).unwrap_err();
    assert_eq!(err.kind(), Kind::Io);
    assert!(!out.exists());
    // A payload given for metadata without literal rows is refused before writing.
    let pkg = tmp.path().join("base/model.pt2");
    let lit = tmp.path().join("lit.safetensors");
    std::fs::write(&lit, payload_bytes(&[]).unwrap()).unwrap();
    let err = artifact::pack(&pkg, &md, Some(&lit), &out).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactLiteralsMismatch);
    assert!(!out.exists());
    assert_eq!(names(tmp.path()), ["base", "lit.safetensors"]);
}

fn table() -> LiteralTensor {
    let bytes: Vec<u8> = [1f32, 2., 3., 4.]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    LiteralTensor {
        fqn: "table".into(),
        dtype: "float32".into(),
        shape: vec![2, 2],
        bytes,
    }
}

#[test]
fn the_payload_writer_pads_its_header_and_orders_by_item_size_then_name() {
    let wide = LiteralTensor {
        fqn: "z".into(),
        dtype: "float64".into(),
        shape: vec![1],
        bytes: vec![0; 8],
    };
    let bytes = payload_bytes(&[table(), wide]).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    assert_eq!(
        header.trim_end_matches(' '),
        r#"{"table":{"data_offsets":[8,24],"dtype":"F32","shape":[2,2]},"z":{"data_offsets":[0,8],"dtype":"F64","shape":[1]}}"#
    );
    assert_eq!(bytes.len(), 8 + n + 24);
}

#[test]
fn the_payload_of_the_spec_literal_verifies_against_its_digest() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("constants.safetensors");
    std::fs::write(&path, payload_bytes(&[table()]).unwrap()).unwrap();
    let row = ConstantRow {
        fqn: "table".into(),
        source: ConstantSource::Literal,
        dtype: "float32".into(),
        shape: vec![2, 2],
    };
    verify_payload(&path, &[&row], "f0bf7306bf0a83cc13766d1b8f990c00").unwrap();
    let err = verify_payload(&path, &[&row], "00000000000000000000000000000000").unwrap_err();
    assert_eq!(err.code(), Code::ArtifactLiteralDigestMismatch);
    let other = ConstantRow {
        dtype: "float16".into(),
        ..row.clone()
    };
    assert_eq!(
        verify_payload(&path, &[&other], "").unwrap_err().code(),
        Code::ArtifactLiteralPayload
    );
}

#[test]
fn the_constant_table_of_the_reference_package_equals_its_metadata_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("ref");
    let report = artifact::unpack(&reference(), &dest, &mut accept()).unwrap();
    let rows = artifact::parse_constant_table(&dest.join("model.pt2")).unwrap();
    assert_eq!(rows, report.metadata.constants());
    assert_eq!(rows[4].source, ConstantSource::Computed);
    assert_eq!(rows[0].fqn, "l1.weight");
}

/// A source that returns at most 3 bytes per read.
struct Trickle(Vec<u8>, usize);

impl Read for Trickle {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (self.0.len() - self.1).min(buf.len()).min(3);
        buf[..n].copy_from_slice(&self.0[self.1..self.1 + n]);
        self.1 += n;
        Ok(n)
    }
}

#[test]
fn the_reader_works_over_a_source_of_tiny_reads() {
    let bytes = std::fs::read(corpus("base-literals.tar.gz")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let report = read_envelope(Trickle(bytes.clone(), 0), tmp.path(), &mut accept()).unwrap();
    assert_eq!(report.compressed_bytes, bytes.len() as u64);
    // Trailing bytes are still seen when they arrive in a later read.
    let mut more = bytes.clone();
    more.push(0);
    let tmp = tempfile::tempdir().unwrap();
    let err = read_envelope(Trickle(more, 0), tmp.path(), &mut accept()).unwrap_err();
    assert_eq!(err.code(), Code::ArtifactGzipTrailing);
    let tmp = tempfile::tempdir().unwrap();
    let err = read_envelope(
        Trickle(bytes[..bytes.len() - 1].to_vec(), 0),
        tmp.path(),
        &mut accept(),
    )
    .unwrap_err();
    assert_eq!(err.code(), Code::ArtifactTruncatedGzip);
}
