//! Store throughput: ingest a file (hash + chunk + fsync) and materialize it.
//!
//! `cargo run --release --example bench_store -- <file> <scratch dir>`
//! prints `name seconds` lines; `scripts/bench_store.sh` compares them with
//! `openssl dgst -sha256` and `cp`.

use std::path::PathBuf;
use std::time::Instant;

use tcg_cas::Store;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let file = PathBuf::from(
        args.next()
            .ok_or("usage: bench_store <file> <scratch dir>")?,
    );
    let scratch = PathBuf::from(
        args.next()
            .ok_or("usage: bench_store <file> <scratch dir>")?,
    );
    let store = Store::open(scratch.join("store"))?;
    let lease = store.lease()?;

    let t = Instant::now();
    let info = store.ingest_file(&lease, &file)?;
    let ingest = t.elapsed().as_secs_f64();
    println!("ingest_seconds {ingest:.3}");
    println!("ingest_bytes {}", info.size);

    let dest = scratch.join("materialized");
    let t = Instant::now();
    let r = store.materialize(&lease, &info.manifest, &dest, false)?;
    println!("materialize_seconds {:.3}", t.elapsed().as_secs_f64());
    println!("materialize_method {:?}", r.method);

    let dest2 = scratch.join("materialized-verified");
    let t = Instant::now();
    store.materialize(&lease, &info.manifest, &dest2, true)?;
    println!(
        "materialize_verified_seconds {:.3}",
        t.elapsed().as_secs_f64()
    );

    // Re-ingesting resident content still hashes every byte (no shortcut).
    let t = Instant::now();
    store.ingest_file(&lease, &file)?;
    println!("reingest_seconds {:.3}", t.elapsed().as_secs_f64());
    println!("file_digest {}", info.file_digest.to_hex());
    Ok(())
}
