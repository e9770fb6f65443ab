//! Resource bounds of the verifiers (docs/FORMAT.md "Resource bounds"):
//! every bound shape of the corpus, and the large shapes generated here, is
//! refused with its code by a child process whose peak memory is measured
//! (`getrusage` max RSS) and bounded; time is bounded by counting work
//! (bytes inflated, bytes scanned), never by a clock.

#[path = "../examples/gen_adversarial/main.rs"]
#[allow(clippy::all)]
mod generator;

use std::io::Read;
use std::path::Path;
use std::process::Command;

use tcg_core::artifact::gzip::GzipReader;
use tcg_core::artifact::package::wrapper::wrapper_scan_work;
use tcg_core::artifact::{self, inflation_cap, Metadata};

/// Peak memory allowed to a child that verifies one shape (generous: the
/// test harness itself takes a few MiB, the bounds allow 64 MiB members).
const MAX_CHILD_RSS_KIB: i64 = 256 << 10;

const CHILD_ENV: &str = "TCG_BOUNDS_CASE";

/// The child: unpack the envelope named by `TCG_BOUNDS_CASE` and print the
/// verdict and the peak RSS. Does nothing in a normal run.
#[test]
fn child_verify() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut admit = |_: &Metadata| Ok(());
    let verdict = match artifact::unpack(Path::new(&path), &tmp.path().join("out"), &mut admit) {
        Ok(_) => "accepted".to_owned(),
        Err(e) => e.code().as_str().to_owned(),
    };
    // SAFETY: getrusage writes one struct this frame owns.
    let rss = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u.ru_maxrss
    };
    println!("VERDICT {verdict} RSS {rss}");
}

/// Verify `path` in a child; its verdict and peak RSS in KiB.
fn verify_in_child(path: &Path) -> (String, i64) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child_verify", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {out:?}");
    let at = stdout
        .find("VERDICT ")
        .unwrap_or_else(|| panic!("no verdict in {stdout}"));
    let line = stdout[at + "VERDICT ".len()..].lines().next().unwrap();
    let (verdict, rss) = line.split_once(" RSS ").unwrap();
    (verdict.to_owned(), rss.trim().parse().unwrap())
}

#[test]
fn every_bound_shape_is_refused_with_its_code_in_bounded_memory() {
    let dir = generator::corpus_dir();
    let tmp = tempfile::tempdir().unwrap();
    let mut shapes: Vec<(std::path::PathBuf, String)> = generator::cases()
        .into_iter()
        .filter(|c| c.file.starts_with("bound-") || c.file.starts_with("elf-phdr-"))
        .map(|c| (dir.join(&c.file), c.code.unwrap().to_owned()))
        .collect();
    assert!(shapes.len() >= 8, "{} bound shapes", shapes.len());
    for c in generator::generated_cases() {
        let path = tmp.path().join(&c.file);
        std::fs::write(&path, &c.bytes).unwrap();
        shapes.push((path, c.code.unwrap().to_owned()));
    }
    let mut failures = Vec::new();
    for (path, code) in &shapes {
        let (verdict, rss) = verify_in_child(path);
        let name = path.file_name().unwrap().to_string_lossy();
        eprintln!("{name}: {verdict}, peak RSS {} MiB", rss >> 10);
        if &verdict != code {
            failures.push(format!("{name}: {verdict}, expected {code}"));
        }
        if rss > MAX_CHILD_RSS_KIB {
            failures.push(format!("{name}: peak RSS {} MiB", rss >> 10));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_high_ratio_envelope_stops_inflating_at_the_ratio_cap() {
    // Work is the bytes inflated before the refusal: bounded by the cap for
    // the compressed bytes read, whatever the declared size.
    for mib in [128u64, 256] {
        let md = generator::fixtures::bases().md_a;
        let env = generator::bounds_cases::high_ratio_envelope(&md, mib);
        let mut r = GzipReader::new(&env[..]).unwrap();
        let mut buf = vec![0u8; 1 << 16];
        let err = loop {
            match r.read(&mut buf) {
                Ok(0) => panic!("{mib} MiB: inflated to the end"),
                Ok(_) => {}
                Err(e) => break e,
            }
        };
        assert_eq!(err.code().as_str(), "artifact.inflation_ratio");
        assert!(
            r.total_out() <= inflation_cap(env.len() as u64) + (1 << 16),
            "{mib} MiB: inflated {} bytes from {}",
            r.total_out(),
            env.len()
        );
    }
}

#[test]
fn the_padded_wrapper_of_the_corpus_scans_in_linear_work() {
    let small = generator::bounds_cases::padded_wrapper(10_000);
    let big = generator::bounds_cases::padded_wrapper(20_000);
    let (ws, wb) = (wrapper_scan_work(&small), wrapper_scan_work(&big));
    assert!(wb <= 2 * ws + ws / 10, "work {ws} -> {wb}");
    assert!(
        wb <= 24 * big.len() as u64,
        "work {wb} for {} bytes",
        big.len()
    );
}

#[test]
fn the_generated_zip_lists_one_entry_over_the_cap() {
    // The fixture proves the cap only if the zip reader sees every entry.
    let c = generator::generated_cases()
        .into_iter()
        .find(|c| c.file == "gen-too-many-entries.tar.gz")
        .unwrap();
    let tar = {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&c.bytes[..])
            .read_to_end(&mut out)
            .unwrap();
        out
    };
    let md_len = generator::fixtures::bases().md_a.len();
    let pkg_at = 512 + md_len.next_multiple_of(512) + 512;
    let zip = std::io::Cursor::new(tar[pkg_at..].to_vec());
    let archive = zip::ZipArchive::new(zip).unwrap();
    assert_eq!(
        archive.len() as u64,
        tcg_core::artifact::MAX_PACKAGE_ENTRIES + 1
    );
}
