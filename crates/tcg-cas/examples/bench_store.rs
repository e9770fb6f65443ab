//! Store throughput: ingest a file (hash + chunk + fsync) and materialize it.
//!
//! `cargo run --release --example bench_store -- <file> <scratch dir> [reps]`
//! prints `name seconds` lines (the best of `reps` runs, each into a fresh
//! store); `scripts/bench_store.sh` compares them with `openssl dgst -sha256`
//! and `cp`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use tcg_cas::{ManifestInfo, Store};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: bench_store <file> <scratch dir> [reps]";
    let mut args = std::env::args().skip(1);
    let file = PathBuf::from(args.next().ok_or(usage)?);
    let scratch = PathBuf::from(args.next().ok_or(usage)?);
    let reps: usize = args.next().map_or(Ok(3), |s| s.parse())?;

    let mut best = [f64::MAX; 3];
    let mut method = None;
    let mut info: Option<ManifestInfo> = None;
    for _ in 0..reps {
        let root = scratch.join("store");
        remove(&root);
        let store = Store::open(&root)?;
        let lease = store.lease()?;
        settle();
        let t = Instant::now();
        let got = store.ingest_file(&lease, &file)?;
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        info = Some(got);

        let dest = scratch.join("materialized");
        remove(&dest);
        settle();
        let t = Instant::now();
        let r = store.materialize(&lease, &got.manifest, &dest, false)?;
        best[1] = best[1].min(t.elapsed().as_secs_f64());
        method = Some(r.method);
        remove(&dest);

        settle();
        let t = Instant::now();
        store.materialize(&lease, &got.manifest, &dest, true)?;
        best[2] = best[2].min(t.elapsed().as_secs_f64());
        remove(&dest);
        lease.end()?;
        remove(&root);
    }
    let info = info.ok_or("reps must be at least 1")?;
    println!("ingest_seconds {:.3}", best[0]);
    println!("ingest_bytes {}", info.size);
    println!("materialize_seconds {:.3}", best[1]);
    println!("materialize_method {:?}", method.expect("ran once"));
    println!("materialize_verified_seconds {:.3}", best[2]);
    println!("file_digest {}", info.file_digest.to_hex());
    Ok(())
}

fn remove(p: &Path) {
    if p.is_dir() {
        // Objects are read-only files in writable directories: removable.
        let _ = std::fs::remove_dir_all(p);
    } else {
        let _ = std::fs::remove_file(p);
    }
}

/// Flush earlier dirty pages so that one step's writeback is not billed to the next.
fn settle() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}
