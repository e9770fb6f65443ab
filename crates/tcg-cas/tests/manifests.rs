//! Manifests: chunking, the streaming writer and reader, strict parsing.

mod common;

use std::io::{Read, Write};

use common::*;
use tcg_cas::{store_error_of, Digest, Manifest, MAX_CHUNK_BYTES};

fn manifest_digest_of(bytes: &[u8]) -> Digest {
    Digest::of(bytes)
}

#[test]
fn empty_file_has_no_chunks_and_the_digest_of_no_bytes() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let info = store.ingest_reader(&lease, &b""[..]).unwrap();
    assert_eq!(info.size, 0);
    assert_eq!(info.file_digest, Digest::of(b""));
    let m = store.load_manifest(&lease, &info.manifest).unwrap();
    assert!(m.chunks.is_empty());
    let raw = store.read_object(&lease, &info.manifest, 1 << 20).unwrap();
    assert_eq!(
        String::from_utf8(raw).unwrap(),
        "{\"chunks\":[],\"digest\":\"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\",\"format\":1,\"size\":0}"
    );
}

#[test]
fn manifest_bytes_are_canonical_json_of_the_pinned_shape() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let info = store.ingest_reader(&lease, &b"abc"[..]).unwrap();
    let raw = store.read_object(&lease, &info.manifest, 1 << 20).unwrap();
    let h = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    assert_eq!(
        String::from_utf8(raw).unwrap(),
        format!("{{\"chunks\":[{{\"digest\":\"sha256:{h}\",\"len\":3}}],\"digest\":\"sha256:{h}\",\"format\":1,\"size\":3}}")
    );
}

#[test]
fn a_writer_of_known_chunks_stores_what_hashing_would_and_refuses_another_layout() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    for len in [0, 1, SMALL_CHUNK as usize, 3 * SMALL_CHUNK as usize + 17] {
        let data = bytes(11, len);
        let hashed = store.ingest_reader(&lease, &data[..]).unwrap();
        let chunks = store
            .load_manifest(&lease, &hashed.manifest)
            .unwrap()
            .chunks;
        let mut w = store.chunked_writer_known(&lease, &chunks);
        for piece in data.chunks(4099) {
            w.write_all(piece).unwrap();
        }
        // The same manifest, file digest included (hashed from byte 0 here).
        assert_eq!(w.finish().unwrap(), hashed, "{len} bytes");
    }
    let data = bytes(12, 2 * SMALL_CHUNK as usize + 5);
    let hashed = store.ingest_reader(&lease, &data[..]).unwrap();
    let chunks = store
        .load_manifest(&lease, &hashed.manifest)
        .unwrap()
        .chunks;
    // A stream that ends early, runs on, or cuts elsewhere fails the writer:
    // it cannot name a chunk it did not hash.
    for wrong in [
        data[..data.len() - 1].to_vec(),
        [&data[..], b"x"].concat(),
        data[..SMALL_CHUNK as usize].to_vec(),
    ] {
        let mut w = store.chunked_writer_known(&lease, &chunks);
        let written = w.write_all(&wrong);
        assert!(
            written.is_err() || w.finish().is_err(),
            "{} bytes",
            wrong.len()
        );
    }
    let mut halves = chunks.clone();
    halves[0].len = SMALL_CHUNK / 2;
    let mut w = store.chunked_writer_known(&lease, &halves);
    let written = w.write_all(&data);
    assert!(written.is_err() || w.finish().is_err());
}

#[test]
fn a_writer_of_known_chunks_continues_from_a_first_chunk_state_only_if_it_is_that_chunks() {
    use sha2::Digest as _;
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let data = bytes(21, 3 * SMALL_CHUNK as usize + 17);
    let hashed = store.ingest_reader(&lease, &data[..]).unwrap();
    let chunks = store
        .load_manifest(&lease, &hashed.manifest)
        .unwrap()
        .chunks;
    let first = &data[..SMALL_CHUNK as usize];
    // The state after the first chunk, sent before the bytes, during the
    // first chunk, or late from another thread (the writer waits for it):
    // the same manifest as hashing from byte 0.
    for when in ["before", "during", "late"] {
        let (tx, rx) = tcg_cas::first_chunk_channel();
        let mut w = store.chunked_writer_known(&lease, &chunks);
        w.continue_from(rx);
        let state = sha2::Sha256::new_with_prefix(first);
        let mut tx = Some(tx);
        let mut late = None;
        match when {
            "before" => tx.take().unwrap().send(state.clone()),
            "late" => {
                let (tx, state) = (tx.take().unwrap(), state.clone());
                late = Some(std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    tx.send(state);
                }));
            }
            _ => {}
        }
        for (i, piece) in data.chunks(4099).enumerate() {
            w.write_all(piece).unwrap();
            if i == 1 {
                if let Some(tx) = tx.take() {
                    tx.send(state.clone());
                }
            }
        }
        assert_eq!(w.finish().unwrap(), hashed, "state sent {when}");
        if let Some(t) = late {
            t.join().unwrap();
        }
    }
    // Another state (one byte short, or another chunk's), or none at all:
    // the writer fails instead of naming a whole-file digest it did not hash.
    let short = sha2::Sha256::new_with_prefix(&first[..first.len() - 1]);
    let other =
        sha2::Sha256::new_with_prefix(&data[SMALL_CHUNK as usize..2 * SMALL_CHUNK as usize]);
    for state in [Some(short), Some(other), None] {
        let (tx, rx) = tcg_cas::first_chunk_channel();
        let mut w = store.chunked_writer_known(&lease, &chunks);
        w.continue_from(rx);
        match state {
            Some(s) => tx.send(s),
            None => drop(tx),
        }
        w.write_all(&data).unwrap();
        assert_eq!(w.finish().unwrap_err().code(), "io.error");
    }
    // Ignored where there is nothing to continue: a single known chunk, or
    // chunks the writer hashes itself.
    let one = bytes(22, SMALL_CHUNK as usize - 3);
    let one_hashed = store.ingest_reader(&lease, &one[..]).unwrap();
    let one_chunks = store
        .load_manifest(&lease, &one_hashed.manifest)
        .unwrap()
        .chunks;
    let (_tx, rx) = tcg_cas::first_chunk_channel();
    let mut w = store.chunked_writer_known(&lease, &one_chunks);
    w.continue_from(rx);
    w.write_all(&one).unwrap();
    assert_eq!(w.finish().unwrap(), one_hashed);
    let (_tx, rx) = tcg_cas::first_chunk_channel();
    let mut w = store.chunked_writer(&lease);
    w.continue_from(rx);
    w.write_all(&data).unwrap();
    assert_eq!(w.finish().unwrap(), hashed);
}

#[test]
fn a_writer_refuses_bytes_after_the_end_of_its_input() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let data = bytes(31, SMALL_CHUNK as usize + 9);
    let hashed = store.ingest_reader(&lease, &data[..]).unwrap();
    for shared in [false, true] {
        let mut w = store.chunked_writer(&lease);
        w.write_all(&data).unwrap();
        w.end_input().unwrap();
        // Announcing it again changes nothing.
        w.end_input().unwrap();
        let code = if shared {
            w.write_shared(std::sync::Arc::new(vec![7u8; 100 << 10]))
                .unwrap_err()
                .code()
        } else {
            let e = w.write_all(b"x").unwrap_err();
            store_error_of(&e).unwrap().code()
        };
        assert_eq!(code, "io.error", "shared: {shared}");
        assert!(w.finish().is_err(), "a refused write poisons the writer");
        // Without the extra bytes the writer stores exactly the input.
        let mut w = store.chunked_writer(&lease);
        w.write_all(&data).unwrap();
        w.end_input().unwrap();
        assert_eq!(w.finish().unwrap(), hashed);
    }
}

#[test]
fn a_stored_file_reads_and_seeks_across_its_chunks() {
    use std::io::{Seek, SeekFrom};
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let data = bytes(21, 3 * SMALL_CHUNK as usize + 17);
    let info = store.ingest_reader(&lease, &data[..]).unwrap();
    let mut f = store.open_stored(&lease, &info.manifest).unwrap();
    assert_eq!(f.len(), data.len() as u64);
    let mut all = Vec::new();
    f.read_to_end(&mut all).unwrap();
    assert_eq!(all, data);
    // Spans that start and end anywhere, across chunk edges included.
    let edge = SMALL_CHUNK as usize;
    for (at, n) in [
        (0, 10),
        (edge - 3, 7),
        (2 * edge - 1, edge + 2),
        (data.len() - 5, 5),
    ] {
        f.seek(SeekFrom::Start(at as u64)).unwrap();
        let mut got = vec![0u8; n];
        f.read_exact(&mut got).unwrap();
        assert_eq!(got, &data[at..at + n], "{at}+{n}");
    }
    assert_eq!(f.seek(SeekFrom::End(-4)).unwrap(), data.len() as u64 - 4);
    assert_eq!(
        f.seek(SeekFrom::Current(-2)).unwrap(),
        data.len() as u64 - 6
    );
    assert!(f.seek(SeekFrom::Current(-(data.len() as i64))).is_err());
    // Past the end reads nothing.
    f.seek(SeekFrom::Start(data.len() as u64 + 9)).unwrap();
    assert_eq!(f.read(&mut [0u8; 4]).unwrap(), 0);
    drop(f);
    // A chunk object that is a link, or of another length, is refused.
    let chunks = store.load_manifest(&lease, &info.manifest).unwrap().chunks;
    let c1 = store.object_path(&chunks[1].digest);
    let copy = dir.path().join("copy");
    std::fs::copy(&c1, &copy).unwrap();
    std::fs::remove_file(&c1).unwrap();
    std::os::unix::fs::symlink(&copy, &c1).unwrap();
    let e = store.open_stored(&lease, &info.manifest).unwrap_err();
    assert_eq!(e.code(), "store.not_regular_file");
    std::fs::remove_file(&c1).unwrap();
    std::fs::write(&c1, b"short").unwrap();
    let e = store.open_stored(&lease, &info.manifest).unwrap_err();
    assert_eq!(e.code(), "store.digest_mismatch");
}

#[test]
fn chunked_writer_cuts_fixed_chunks_from_offset_zero_whatever_the_write_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let data = bytes(7, 5 * SMALL_CHUNK as usize + 123);
    let mut infos = Vec::new();
    for step in [1usize, 7, 4096, 16 * 1024, 100_000, data.len()] {
        let mut w = store.chunked_writer(&lease);
        for piece in data.chunks(step) {
            w.write_all(piece).unwrap();
        }
        infos.push(w.finish().unwrap());
    }
    assert!(infos.windows(2).all(|w| w[0] == w[1]));
    let info = infos[0];
    assert_eq!(info.file_digest, Digest::of(&data));
    assert_eq!(info.size, data.len() as u64);
    let m = store.load_manifest(&lease, &info.manifest).unwrap();
    assert_eq!(m.chunks.len(), 6);
    assert!(m.chunks[..5].iter().all(|c| c.len == SMALL_CHUNK));
    assert_eq!(m.chunks[5].len, 123);
    for (i, c) in m.chunks.iter().enumerate() {
        let s = i * SMALL_CHUNK as usize;
        let e = (s + SMALL_CHUNK as usize).min(data.len());
        assert_eq!(c.digest, Digest::of(&data[s..e]));
    }
    let mut out = Vec::new();
    store
        .open_file(&lease, &info.manifest, true)
        .unwrap()
        .read_to_end(&mut out)
        .unwrap();
    assert_eq!(out, data);
    // A file of exactly one chunk length has one chunk.
    let exact = store
        .ingest_reader(&lease, &data[..SMALL_CHUNK as usize])
        .unwrap();
    let m = store.load_manifest(&lease, &exact.manifest).unwrap();
    assert_eq!(m.chunks.len(), 1);
    assert_eq!(m.chunks[0].digest, m.file_digest);
}

#[test]
fn a_file_longer_than_64_mib_gets_a_second_chunk_in_the_real_store() {
    let (d, store) = new_store();
    let path = d.path().join("big");
    let data = bytes(9, MAX_CHUNK_BYTES as usize + 1000);
    std::fs::write(&path, &data).unwrap();
    let lease = store.lease().unwrap();
    let info = store.ingest_file(&lease, &path).unwrap();
    assert_eq!(info.file_digest, Digest::of(&data));
    let m = store.load_manifest(&lease, &info.manifest).unwrap();
    assert_eq!(
        m.chunks.iter().map(|c| c.len).collect::<Vec<_>>(),
        vec![MAX_CHUNK_BYTES, 1000]
    );
}

#[test]
fn chunked_reader_errors_at_the_end_of_a_corrupt_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let data = bytes(8, 3 * SMALL_CHUNK as usize);
    let info = store.ingest_reader(&lease, &data[..]).unwrap();
    let m = store.load_manifest(&lease, &info.manifest).unwrap();
    let p = store.object_path(&m.chunks[1].digest);
    let mut bad = std::fs::read(&p).unwrap();
    bad[5] ^= 4;
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, &bad).unwrap();
    let mut r = store.open_file(&lease, &info.manifest, true).unwrap();
    let mut out = Vec::new();
    let e = r.read_to_end(&mut out).unwrap_err();
    assert_eq!(store_error_of(&e).unwrap().code(), "store.digest_mismatch");
    assert!(out.len() < 2 * SMALL_CHUNK as usize);
    // A truncated chunk is refused by length when it is opened.
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, &bad[..100]).unwrap();
    let mut r = store.open_file(&lease, &info.manifest, true).unwrap();
    let e = r.read_to_end(&mut Vec::new()).unwrap_err();
    assert_eq!(store_error_of(&e).unwrap().code(), "store.digest_mismatch");
}

#[test]
fn dropping_an_unfinished_writer_leaves_no_temp() {
    let dir = tempfile::tempdir().unwrap();
    let store = small_store(&dir.path().join("s"));
    let lease = store.lease().unwrap();
    let mut w = store.chunked_writer(&lease);
    w.write_all(&bytes(3, 40_000)).unwrap();
    drop(w);
    assert!(dir_entries(&store.root().join("tmp")).is_empty());
}

fn parse(text: &str) -> Result<Manifest, tcg_cas::StoreError> {
    Manifest::parse(text.as_bytes(), &manifest_digest_of(text.as_bytes()))
}

#[test]
fn manifest_parser_refuses_every_rule_violation() {
    let h = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    let e0 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    let good = format!("{{\"chunks\":[{{\"digest\":\"sha256:{h}\",\"len\":3}}],\"digest\":\"sha256:{h}\",\"format\":1,\"size\":3}}");
    assert!(parse(&good).is_ok());
    let big = MAX_CHUNK_BYTES;
    let refusals = [
        ("not json", "{".to_string()),
        ("not an object", "[]".to_string()),
        ("whitespace", good.replace(",\"format\"", ", \"format\"")),
        ("member order", format!("{{\"digest\":\"sha256:{h}\",\"chunks\":[{{\"digest\":\"sha256:{h}\",\"len\":3}}],\"format\":1,\"size\":3}}")),
        ("extra member", good.replace("\"size\":3}", "\"size\":3,\"x\":1}")),
        ("missing size", good.replace(",\"size\":3", "")),
        ("format float", good.replace("\"format\":1", "\"format\":1.0")),
        ("format string", good.replace("\"format\":1", "\"format\":\"1\"")),
        ("uppercase hex", good.replace("ba78", "BA78")),
        ("short hex", good.replace(&format!("sha256:{h}\",\"format"), "sha256:abcd\",\"format")),
        ("no prefix", good.replace(&format!("\"digest\":\"sha256:{h}\",\"format"), &format!("\"digest\":\"{h}\",\"format"))),
        ("negative size", good.replace("\"size\":3", "\"size\":-3")),
        ("sum mismatch", good.replace("\"size\":3", "\"size\":4")),
        ("zero len", good.replace("\"len\":3", "\"len\":0").replace("\"size\":3", "\"size\":0")),
        ("len too big", good.replace("\"len\":3", &format!("\"len\":{}", big + 1)).replace("\"size\":3", &format!("\"size\":{}", big + 1))),
        ("chunk extra member", good.replace("\"len\":3}", "\"len\":3,\"x\":0}")),
        ("single chunk digest differs", good.replace(&format!("\"digest\":\"sha256:{h}\",\"format"), &format!("\"digest\":\"sha256:{e0}\",\"format"))),
        ("short first chunk", format!("{{\"chunks\":[{{\"digest\":\"sha256:{h}\",\"len\":3}},{{\"digest\":\"sha256:{h}\",\"len\":3}}],\"digest\":\"sha256:{e0}\",\"format\":1,\"size\":6}}")),
        ("empty with wrong digest", format!("{{\"chunks\":[],\"digest\":\"sha256:{h}\",\"format\":1,\"size\":0}}")),
        ("duplicate member", good.replace("\"size\":3}", "\"size\":3,\"size\":3}")),
    ];
    for (why, text) in refusals {
        let e = parse(&text).expect_err(why);
        assert_eq!(e.code(), "store.manifest_invalid", "{why}: {e}");
    }
}

#[test]
fn manifest_with_another_integer_format_is_an_unreadable_format() {
    let e = parse("{\"chunks\":[],\"format\":2,\"whatever\":true}").unwrap_err();
    assert_eq!(e.code(), "store.format_unsupported");
    assert!(matches!(
        e,
        tcg_cas::StoreError::RecordFormatUnsupported { format: 2, .. }
    ));
}

#[test]
fn loading_a_manifest_rehashes_it() {
    let (_d, store) = new_store();
    let lease = store.lease().unwrap();
    let info = store.ingest_reader(&lease, &b"abc"[..]).unwrap();
    let p = store.object_path(&info.manifest);
    let mut raw = std::fs::read(&p).unwrap();
    let n = raw.len();
    raw[n - 2] = b'4'; // "size":3 -> "size":4
    std::fs::remove_file(&p).unwrap();
    std::fs::write(&p, &raw).unwrap();
    let e = store.load_manifest(&lease, &info.manifest).unwrap_err();
    assert_eq!(e.code(), "store.digest_mismatch");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Any valid manifest survives encode -> parse, and its bytes are canonical.
    #[test]
    fn manifest_encoding_round_trips(
        full in 0u64..5,
        last in 1u64..=MAX_CHUNK_BYTES,
        seed in proptest::prelude::any::<u64>(),
    ) {
        let mut chunks = Vec::new();
        for i in 0..full {
            chunks.push(tcg_cas::Chunk { digest: Digest::of(&(seed + i).to_le_bytes()), len: MAX_CHUNK_BYTES });
        }
        chunks.push(tcg_cas::Chunk { digest: Digest::of(&seed.to_be_bytes()), len: last });
        let file_digest = if chunks.len() == 1 { chunks[0].digest } else { Digest::of(b"whole") };
        let size = chunks.iter().map(|c| c.len).sum();
        let m = Manifest { file_digest, size, chunks };
        let bytes = m.to_bytes();
        let back = Manifest::parse(&bytes, &Digest::of(&bytes)).unwrap();
        proptest::prop_assert_eq!(back, m);
    }

    /// Shared frames (kept by reference, cut at chunk edges) and copied
    /// writes, in any mix and any sizes, store what one copied write would,
    /// with or without the chunk digests known in advance, whatever size the
    /// writer was told to expect, and with or without the input's end
    /// announced before `finish`.
    #[test]
    fn shared_frames_store_what_copied_bytes_would(
        len in 0usize..(400 << 10),
        cuts in proptest::collection::vec(1usize..(150 << 10), 1..12),
        seed in proptest::prelude::any::<u64>(),
        known in proptest::prelude::any::<bool>(),
        hint in proptest::option::of(0u64..(800 << 10)),
        end_early in proptest::prelude::any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = small_store(&dir.path().join("s"));
        let lease = store.lease().unwrap();
        let data = bytes(seed, len);
        let hashed = store.ingest_reader(&lease, &data[..]).unwrap();
        let chunks = store.load_manifest(&lease, &hashed.manifest).unwrap().chunks;
        let mut w = match (known, hint) {
            (true, _) => store.chunked_writer_known(&lease, &chunks),
            (false, Some(size)) => store.chunked_writer_sized(&lease, size),
            (false, None) => store.chunked_writer(&lease),
        };
        let (mut off, mut i) = (0, 0);
        while off < data.len() {
            let n = cuts[i % cuts.len()].min(data.len() - off);
            let piece = data[off..off + n].to_vec();
            if i % 3 == 2 {
                w.write_all(&piece).unwrap();
            } else {
                w.write_shared(std::sync::Arc::new(piece)).unwrap();
            }
            off += n;
            i += 1;
        }
        if end_early {
            w.end_input().unwrap();
        }
        proptest::prop_assert_eq!(w.finish().unwrap(), hashed);
    }

    /// Ingest of any byte string reads back identically, whatever the write sizes.
    #[test]
    fn ingest_then_read_returns_the_same_bytes(
        len in 0usize..(3 * SMALL_CHUNK as usize + 10),
        step in 1usize..20_000,
        seed in proptest::prelude::any::<u64>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = small_store(&dir.path().join("s"));
        let lease = store.lease().unwrap();
        let data = bytes(seed, len);
        let mut w = store.chunked_writer(&lease);
        for piece in data.chunks(step) {
            w.write_all(piece).unwrap();
        }
        let info = w.finish().unwrap();
        proptest::prop_assert_eq!(info.file_digest, Digest::of(&data));
        let mut out = Vec::new();
        store.open_file(&lease, &info.manifest, true).unwrap().read_to_end(&mut out).unwrap();
        proptest::prop_assert_eq!(out, data);
    }
}
