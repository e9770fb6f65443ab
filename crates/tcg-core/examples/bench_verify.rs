//! Benchmark: full verification of a 256 MiB envelope against a bare
//! `gzip -dc ENVELOPE > /dev/null` of the same file, in the same run.
//!
//! The envelope is the reference 0.2.0 artifact whose `model.pt2` gains one
//! large stored entry of incompressible bytes inside its entry directory (the
//! envelope's member set is fixed, so the bulk has to live in the package).
//!
//! ```text
//! cargo run --release -p tcg-core --example bench_verify [-- --mib 256 --runs 5 --code]
//! ```
//!
//! The envelope is built once under `bench-out/` (git-ignored) and reused.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tcg_core::artifact::{self, Metadata};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64* bytes: deterministic and incompressible for deflate.
fn fill_random(buf: &mut [u8], state: &mut u64) {
    for chunk in buf.chunks_mut(8) {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        let v = state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn build(envelope: &Path, total_mib: u64, code_like: bool) {
    let work = tempfile::tempdir().unwrap();
    let reference = repo().join("testdata/reference-0.2.0/mlp-cpu.tar.gz");
    let unpacked = work.path().join("ref");
    let mut admit = |_: &Metadata| Ok(());
    artifact::unpack(&reference, &unpacked, &mut admit).unwrap();
    let md_bytes = std::fs::read(unpacked.join("metadata.json")).unwrap();
    let md = tcg_cj::parse_strict(&md_bytes).unwrap();
    let src = std::fs::File::open(unpacked.join("model.pt2")).unwrap();
    let src_len = src.metadata().unwrap().len();
    let mut archive = zip::ZipArchive::new(src).unwrap();
    let big = work.path().join("model.pt2");
    let mut w = zip::ZipWriter::new(std::fs::File::create(&big).unwrap());
    for i in 0..archive.len() {
        w.raw_copy_file(archive.by_index_raw(i).unwrap()).unwrap();
    }
    let blob_len = (total_mib << 20).saturating_sub(src_len + 4096);
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .large_file(blob_len >= u32::MAX as u64);
    w.start_file("model/data/aotinductor/model/mlp/bench.blob", opts)
        .unwrap();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut buf = vec![0u8; 1 << 20];
    // `--code`: repeat the reference `.so` instead, for a compressible body
    // closer to real packages (deflate does real work on it).
    let so = if code_like {
        let name = (0..archive.len())
            .map(|i| archive.by_index(i).unwrap().name().unwrap().into_owned())
            .find(|n| n.ends_with(".so"))
            .unwrap();
        let mut v = Vec::new();
        archive.by_name(&name).unwrap().read_to_end(&mut v).unwrap();
        v
    } else {
        Vec::new()
    };
    let mut left = blob_len;
    let mut at = 0usize;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        if code_like {
            for b in &mut buf[..n] {
                *b = so[at % so.len()];
                at += 1;
            }
        } else {
            fill_random(&mut buf[..n], &mut state);
        }
        w.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    w.finish().unwrap();
    let t = Instant::now();
    artifact::pack(&big, &md, None, envelope).unwrap();
    eprintln!(
        "built {} ({} bytes, model.pt2 {} bytes) in {:.1?}",
        envelope.display(),
        std::fs::metadata(envelope).unwrap().len(),
        std::fs::metadata(&big).unwrap().len(),
        t.elapsed()
    );
}

fn gunzip(path: &Path) -> Duration {
    let t = Instant::now();
    let status = Command::new("gzip")
        .arg("-dc")
        .arg(path)
        .stdout(Stdio::null())
        .status()
        .expect("gzip runs");
    assert!(status.success());
    t.elapsed()
}

fn verify(path: &Path) -> Duration {
    let t = Instant::now();
    artifact::verify(path, false).expect("the bench envelope verifies");
    t.elapsed()
}

fn stats(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    (v[0], v[v.len() / 2])
}

fn main() {
    let mib = arg("--mib", 256);
    let runs = arg("--runs", 5) as usize;
    let dir = repo().join("bench-out");
    std::fs::create_dir_all(&dir).unwrap();
    let code_like = std::env::args().any(|a| a == "--code");
    let kind = if code_like { "code" } else { "random" };
    let envelope = dir.join(format!("bench-{mib}m-{kind}.tar.gz"));
    if !envelope.exists() {
        build(&envelope, mib, code_like);
    }
    let size = std::fs::metadata(&envelope).unwrap().len();
    let mut tar_len = 0u64;
    let mut d = flate2::read::GzDecoder::new(std::fs::File::open(&envelope).unwrap());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = d.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        tar_len += n as u64;
    }
    // Warm the page cache, then interleave the two measurements.
    gunzip(&envelope);
    verify(&envelope);
    let (mut g, mut v) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        g.push(gunzip(&envelope));
        v.push(verify(&envelope));
    }
    let (gmin, gmed) = stats(g);
    let (vmin, vmed) = stats(v);
    let mbps = |t: Duration| tar_len as f64 / (1 << 20) as f64 / t.as_secs_f64();
    println!("envelope: {size} bytes compressed, {tar_len} bytes of tar");
    println!(
        "gzip -dc > /dev/null : min {gmin:.3?} median {gmed:.3?} ({:.0} MiB/s)",
        mbps(gmed)
    );
    println!(
        "artifact::verify     : min {vmin:.3?} median {vmed:.3?} ({:.0} MiB/s)",
        mbps(vmed)
    );
    println!(
        "ratio verify/gunzip  : min {:.2} median {:.2}",
        vmin.as_secs_f64() / gmin.as_secs_f64(),
        vmed.as_secs_f64() / gmed.as_secs_f64()
    );
}
