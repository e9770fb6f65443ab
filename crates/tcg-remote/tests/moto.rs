//! The fleet tier against a real S3 server: moto (`moto[server]==5.2.5`,
//! installed into the repository's .venv by `make deps`), started here on a
//! free loopback port. A missing moto_server fails these tests loudly.

#[path = "../../tcg-core/tests/common/mod.rs"]
mod common;
mod support;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{counting_mint, other_key_envelope, reference, reference_mint, KEY};
use support::{moto_as_default_endpoint, request, stat};
use tcg_cas::{Digest, Manifest};
use tcg_core::engine::{Engine, EnsureOutcome, Flight, RemoteTier, Source, StoreOutcome};
use tcg_remote::publish::create_ref;
use tcg_remote::{Fail, RefRecord, Remote, RemoteConfig};

/// A fresh bucket that a remote configured by URL alone reaches.
fn bucket() -> String {
    moto_as_default_endpoint();
    support::bucket()
}

fn remote(url: &str) -> Arc<Remote> {
    let mut c = RemoteConfig::new(url).unwrap();
    c.timeout = Duration::from_secs(10);
    c.wait = Duration::from_secs(60);
    c.lease_ttl = Duration::from_secs(3);
    Arc::new(Remote::new(c).unwrap())
}

fn engine(dir: &Path, r: &Arc<Remote>) -> Engine {
    Engine::open(dir).unwrap().with_remote(r.clone())
}

/// A store holding the reference artifact, pushed to the remote.
fn published(dir: &Path, r: &Arc<Remote>) -> Engine {
    let a = engine(&dir.join("a"), r);
    a.import_artifact(KEY, &reference()).unwrap();
    let rows = tcg_remote::ops::push(&a, r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
    let row = rows.as_array().unwrap()[0].as_object().unwrap();
    assert_eq!(row["outcome"].as_str(), Some("STORED"), "{rows:?}");
    a
}

#[test]
fn a_published_graph_is_fetched_verified_and_then_served_locally() {
    let d = tempfile::tempdir().unwrap();
    let r = remote(&bucket());
    let a = published(d.path(), &r);
    let b = engine(&d.path().join("b"), &remote(&r.config().url));
    let got = b.resolve(KEY, &d.path().join("g1")).unwrap().unwrap();
    assert_eq!(got.source, Source::Remote);
    assert_eq!(stat(&b, "remote_hits"), 1);
    // The same manifest on both tiers: chunks are the local store's.
    let a_m = a
        .resolve(KEY, &d.path().join("ga"))
        .unwrap()
        .unwrap()
        .manifest;
    assert_eq!(got.manifest, a_m);
    let again = b.resolve(KEY, &d.path().join("g2")).unwrap().unwrap();
    assert_eq!(again.source, Source::Local);
    assert_eq!(stat(&b, "remote_hits"), 1);
    assert!(d.path().join("g2/model.pt2").exists());
}

#[test]
fn the_layout_and_the_ref_record_are_wire_identity() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let r = remote(&url);
    let a = published(d.path(), &r);
    let m = a
        .resolve(KEY, &d.path().join("g"))
        .unwrap()
        .unwrap()
        .manifest;
    let c = r.client().unwrap();
    let l = r.layout();
    assert_eq!(
        l.graph_ref(KEY).to_string(),
        format!("fleet/tcg/v1/refs/{KEY}")
    );
    assert_eq!(
        l.manifest(&Digest::from_hex(&m).unwrap()).to_string(),
        format!("fleet/tcg/v1/manifests/sha256/{m}")
    );
    let (bytes, _) = c.get_small(&l.graph_ref(KEY), 4096).unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    assert!(
        text.starts_with(r#"{"created":"#)
            && text.contains(&format!(
                r#""format":1,"key":"{KEY}","manifest":"sha256:{m}","producer":"#
            )),
        "{text}"
    );
    let (mbytes, _) = c
        .get_small(&l.manifest(&Digest::from_hex(&m).unwrap()), 1 << 20)
        .unwrap();
    let man = Manifest::parse(&mbytes, &Digest::from_hex(&m).unwrap()).unwrap();
    for ch in &man.chunks {
        let h = ch.digest.to_hex();
        assert_eq!(
            l.chunk(&ch.digest).to_string(),
            format!("fleet/tcg/v1/chunks/sha256/{}/{h}", &h[..2])
        );
        assert_eq!(c.head(&l.chunk(&ch.digest)).unwrap().size, ch.len);
    }
}

#[test]
fn the_ref_is_first_writer_wins_with_read_back() {
    let r = remote(&bucket());
    let c = r.client().unwrap();
    let rec = |m: &[u8]| RefRecord {
        key: KEY.into(),
        manifest: Digest::of(m),
        producer: "test".into(),
        created: 1,
    };
    let first = create_ref(c, r.layout(), &rec(b"one")).unwrap();
    assert_eq!(first.outcome, StoreOutcome::Stored);
    // A retry after a commit reads back our own manifest.
    let again = create_ref(c, r.layout(), &rec(b"one")).unwrap();
    assert_eq!(again.outcome, StoreOutcome::Present);
    let lost = create_ref(c, r.layout(), &rec(b"two")).unwrap();
    assert_eq!(lost.outcome, StoreOutcome::Divergent);
    assert_eq!(lost.manifest, Digest::of(b"one").to_hex());
}

#[test]
fn ensure_publishes_a_mint_and_another_store_reuses_it_without_minting() {
    let d = tempfile::tempdir().unwrap();
    let r = remote(&bucket());
    let a = engine(&d.path().join("a"), &r);
    let calls = std::cell::Cell::new(0);
    let work = d.path().join("work-a");
    std::fs::create_dir_all(&work).unwrap();
    let mut mint = counting_mint(&calls, &work);
    let first = a
        .ensure(KEY, &d.path().join("ga"), &request(), &mut mint)
        .unwrap();
    assert_eq!(first.outcome, EnsureOutcome::Minted);
    assert_eq!(first.resolved.source, Source::Compiled);
    assert_eq!(
        first.remote_publication.as_ref().map(|p| p.outcome),
        Some(StoreOutcome::Stored)
    );
    assert_eq!(stat(&a, "remote_published"), 1);
    let b = engine(&d.path().join("b"), &r);
    let calls_b = std::cell::Cell::new(0);
    let work_b = d.path().join("work-b");
    std::fs::create_dir_all(&work_b).unwrap();
    let mut mint_b = counting_mint(&calls_b, &work_b);
    let second = b
        .ensure(KEY, &d.path().join("gb"), &request(), &mut mint_b)
        .unwrap();
    assert_eq!(second.outcome, EnsureOutcome::Reused);
    assert_eq!(second.resolved.source, Source::Remote);
    assert_eq!(calls_b.get(), 0);
    assert_eq!(second.resolved.manifest, first.resolved.manifest);
}

#[test]
fn workers_on_separate_stores_mint_once_through_the_lease() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let minted = Arc::new(Mutex::new(0u32));
    let workers: Vec<_> = (0..4)
        .map(|i| {
            let (dir, url, minted) = (d.path().to_path_buf(), url.clone(), minted.clone());
            std::thread::spawn(move || {
                let e = engine(&dir.join(format!("s{i}")), &remote(&url));
                let work = dir.join(format!("w{i}"));
                std::fs::create_dir_all(&work).unwrap();
                let mut mint = || {
                    *minted.lock().unwrap() += 1;
                    // A compile that outlives a lease renewal (ttl 3 s).
                    std::thread::sleep(Duration::from_secs(4));
                    Ok(reference_mint(&work))
                };
                let r = e
                    .ensure(KEY, &dir.join(format!("g{i}")), &request(), &mut mint)
                    .unwrap();
                (r.outcome, r.resolved.source)
            })
        })
        .collect();
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    assert_eq!(*minted.lock().unwrap(), 1, "{results:?}");
    assert_eq!(
        results
            .iter()
            .filter(|(o, s)| *o == EnsureOutcome::Reused && *s == Source::Remote)
            .count(),
        3,
        "{results:?}"
    );
    // The leader deleted its lease.
    let r = remote(&url);
    assert!(matches!(
        r.client().unwrap().head(&r.layout().lease(KEY)),
        Err(Fail::NotFound)
    ));
}

#[test]
fn a_live_lease_is_followed_and_an_expired_one_is_taken_over() {
    let url = bucket();
    let (one, two) = (remote(&url), remote(&url));
    let lead = one.begin_flight(KEY);
    assert!(matches!(lead, Flight::Lead(_)));
    // Renewed past its ttl (3 s) while held.
    std::thread::sleep(Duration::from_secs(5));
    assert!(matches!(two.begin_flight(KEY), Flight::Follow));
    drop(lead);
    let c = one.client().unwrap();
    assert!(matches!(
        c.head(&one.layout().lease(KEY)),
        Err(Fail::NotFound)
    ));
    // A crashed holder's lease (never renewed) expires by the server's clock.
    let stale = tcg_remote::LeaseRecord {
        holder: "0".repeat(32),
        host: "crashed".into(),
        ttl_s: 1,
    };
    c.create(&one.layout().lease(KEY), Bytes::from(stale.to_bytes()))
        .unwrap();
    assert!(matches!(two.begin_flight(KEY), Flight::Follow));
    std::thread::sleep(Duration::from_millis(2500));
    let took = two.begin_flight(KEY);
    assert!(matches!(took, Flight::Lead(_)));
}

fn reports(r: &Remote) -> usize {
    r.client()
        .unwrap()
        .list(&r.layout().folder("reports"), 100)
        .unwrap()
        .len()
}

#[test]
fn a_ref_pointing_at_another_keys_artifact_is_never_served_and_is_reported() {
    let d = tempfile::tempdir().unwrap();
    let r = remote(&bucket());
    let a = engine(&d.path().join("a"), &r);
    let (other, envelope) = other_key_envelope(d.path(), "9.9.9");
    a.import_artifact(&other, &envelope).unwrap();
    tcg_remote::ops::push(&a, &r, std::slice::from_ref(&other), &mut |_, _| {}).unwrap();
    let m = a
        .store()
        .get_ref(&tcg_core::engine::graph_ref(&other))
        .unwrap()
        .unwrap()
        .digest;
    let c = r.client().unwrap();
    let forged = RefRecord {
        key: KEY.into(),
        manifest: m,
        producer: "forger".into(),
        created: 0,
    };
    c.create(&r.layout().graph_ref(KEY), Bytes::from(forged.to_bytes()))
        .unwrap();
    let b = engine(&d.path().join("b"), &r);
    assert!(b.resolve(KEY, &d.path().join("g")).unwrap().is_none());
    assert!(!d.path().join("g").exists());
    assert_eq!(stat(&b, "remote_reports"), 1);
    assert_eq!(reports(&r), 1);
    assert!(b
        .store()
        .get_ref(&tcg_core::engine::graph_ref(KEY))
        .unwrap()
        .is_none());
}

#[test]
fn corrupted_missing_and_hostile_records_are_misses() {
    let d = tempfile::tempdir().unwrap();
    let r = remote(&bucket());
    published(d.path(), &r);
    let c = r.client().unwrap();
    let l = r.layout();
    let (rb, _) = c.get_small(&l.graph_ref(KEY), 4096).unwrap();
    let rec = RefRecord::parse(&rb).unwrap();
    let (mb, _) = c.get_small(&l.manifest(&rec.manifest), 1 << 20).unwrap();
    let man = Manifest::parse(&mb, &rec.manifest).unwrap();
    let chunk = l.chunk(&man.chunks[0].digest);
    let (good, _) = c.get_small(&chunk, 1 << 26).unwrap();

    // A corrupted chunk (same length): proof, reported.
    let mut bad = good.to_vec();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    c.put(&chunk, Bytes::from(bad), object_store::PutMode::Overwrite)
        .unwrap();
    let b = engine(&d.path().join("b"), &r);
    assert!(b.resolve(KEY, &d.path().join("g1")).unwrap().is_none());
    assert_eq!(stat(&b, "remote_reports"), 1);

    // A missing chunk: a miss, no evidence.
    c.delete(&chunk).unwrap();
    assert!(b.resolve(KEY, &d.path().join("g2")).unwrap().is_none());
    assert_eq!(stat(&b, "remote_reports"), 1);
    assert_eq!(stat(&b, "remote_misses"), 1);

    // A hostile manifest: huge size, then the wrong SHA-256 for its name.
    c.put(&chunk, good.clone(), object_store::PutMode::Overwrite)
        .unwrap();
    let huge = format!(
        r#"{{"chunks":[{{"digest":"sha256:{}","len":67108864}}],"digest":"sha256:{}","format":1,"size":99999999999999}}"#,
        "a".repeat(64),
        "a".repeat(64)
    );
    let hm = Digest::of(huge.as_bytes());
    c.put(
        &l.manifest(&hm),
        Bytes::from(huge),
        object_store::PutMode::Overwrite,
    )
    .unwrap();
    let key2 = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd3631";
    let forged = RefRecord {
        key: key2.into(),
        manifest: hm,
        producer: "hostile".into(),
        created: 0,
    };
    c.create(&l.graph_ref(key2), Bytes::from(forged.to_bytes()))
        .unwrap();
    assert!(b.resolve(key2, &d.path().join("g3")).unwrap().is_none());
    assert_eq!(stat(&b, "remote_reports"), 2);
    // Still servable after all that: the good record fetches.
    assert!(b.resolve(KEY, &d.path().join("g4")).unwrap().is_some());
}

/// A manifest whose chunks are the real, intact chunks but which states
/// another whole-file digest: every chunk verifies, yet the record is proven
/// inconsistent (the local manifest made from the verified bytes differs).
#[test]
fn a_manifest_stating_another_file_digest_over_intact_chunks_is_reported() {
    let d = tempfile::tempdir().unwrap();
    let r = remote(&bucket());
    published(d.path(), &r);
    let c = r.client().unwrap();
    let l = r.layout();
    let (rb, _) = c.get_small(&l.graph_ref(KEY), 4096).unwrap();
    let rec = RefRecord::parse(&rb).unwrap();
    let (mb, _) = c.get_small(&l.manifest(&rec.manifest), 1 << 20).unwrap();
    let mut man = Manifest::parse(&mb, &rec.manifest).unwrap();
    man.file_digest = Digest::of(b"not the file");
    let lie = man.to_bytes();
    let lm = Digest::of(&lie);
    c.put(
        &l.manifest(&lm),
        Bytes::from(lie),
        object_store::PutMode::Overwrite,
    )
    .unwrap();
    c.delete(&l.graph_ref(KEY)).unwrap();
    let forged = RefRecord {
        manifest: lm,
        ..rec
    };
    c.create(&l.graph_ref(KEY), Bytes::from(forged.to_bytes()))
        .unwrap();
    let b = engine(&d.path().join("b"), &r);
    assert!(b.resolve(KEY, &d.path().join("g")).unwrap().is_none());
    assert!(!d.path().join("g").exists());
    assert_eq!(stat(&b, "remote_hits"), 0);
    assert_eq!(stat(&b, "remote_reports"), 1);
    assert_eq!(reports(&r), 1);
    assert!(b
        .store()
        .get_ref(&tcg_core::engine::graph_ref(KEY))
        .unwrap()
        .is_none());
}

#[test]
fn a_local_hit_never_builds_the_client_and_an_unreachable_remote_is_a_miss() {
    let d = tempfile::tempdir().unwrap();
    moto_as_default_endpoint();
    // Nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = || {
        let mut cfg = RemoteConfig::new("s3://nowhere/x").unwrap();
        cfg.timeout = Duration::from_secs(1);
        cfg.options = vec![("aws_endpoint".into(), format!("http://127.0.0.1:{port}"))];
        Arc::new(Remote::new(cfg).unwrap())
    };
    let r = dead();
    let e = engine(&d.path().join("s"), &r);
    e.import_artifact(KEY, &reference()).unwrap();
    assert!(e.resolve(KEY, &d.path().join("g")).unwrap().is_some());
    assert!(!r.is_connected(), "a hit built the remote client");
    // A miss on a dead endpoint: counted, a warning, not an error.
    let other = "cg-key-v1-ddd506362c49696787e3eb3d0e44c08b00a6358015d9004ba1cd3630";
    assert!(e.resolve(other, &d.path().join("g2")).unwrap().is_none());
    assert!(r.is_connected());
    assert_eq!(stat(&e, "remote_errors"), 1);
    assert_eq!(stat(&e, "remote_hits"), 0);
    // ensure compiles locally when the remote is down, and still succeeds.
    let calls = std::cell::Cell::new(0);
    let work = d.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut mint = counting_mint(&calls, &work);
    let e2 = engine(&d.path().join("s2"), &dead());
    let out = e2
        .ensure(KEY, &d.path().join("g3"), &request(), &mut mint)
        .unwrap();
    assert_eq!(out.outcome, EnsureOutcome::Minted);
    assert_eq!(calls.get(), 1);
    assert!(out.remote_publication.is_none());
}

#[test]
fn fleet_doctor_qualifies_moto_and_ls_fsck_gc_see_the_records() {
    let d = tempfile::tempdir().unwrap();
    let r = remote(&bucket());
    let v = tcg_remote::doctor::run(&r).unwrap();
    assert!(v.qualified(), "{v:?}");
    assert_eq!(v.race_winners, 1);
    // moto stores an upload whose bytes do not match its checksum (it does
    // not validate checksums): reported as accepted, not a failed verdict.
    assert_eq!(v.checksum_refused, Some(false), "{v:?}");
    assert_eq!(
        tcg_remote::doctor::cached_verdict(&r.config().url),
        Some(true)
    );
    published(d.path(), &r);
    let ls = tcg_remote::ops::ls(&r).unwrap();
    assert_eq!(ls.as_array().unwrap().len(), 1);
    let (_, clean) = tcg_remote::ops::fsck(&r, true).unwrap();
    assert!(clean);
    // An orphan chunk older than the grace is swept; reachable ones stay.
    let c = r.client().unwrap();
    let orphan = r.layout().chunk(&Digest::of(b"orphan"));
    c.put(
        &orphan,
        Bytes::from_static(b"orphan"),
        object_store::PutMode::Overwrite,
    )
    .unwrap();
    let kept = tcg_remote::ops::gc(&r, Duration::from_secs(3600), &mut |_, _| {}).unwrap();
    assert_eq!(
        kept.as_object().unwrap()["freed_objects"],
        tcg_cj::Value::Int(0)
    );
    std::thread::sleep(Duration::from_millis(2100));
    let swept = tcg_remote::ops::gc(&r, Duration::from_secs(1), &mut |_, _| {}).unwrap();
    assert_eq!(
        swept.as_object().unwrap()["freed_objects"],
        tcg_cj::Value::Int(1)
    );
    let (_, clean) = tcg_remote::ops::fsck(&r, true).unwrap();
    assert!(clean);
}

#[test]
fn a_remote_the_doctor_failed_is_used_without_single_flight() {
    let url = bucket();
    let r = remote(&url);
    assert!(matches!(r.begin_flight(KEY), Flight::Lead(_)));
    // What `fleet doctor` caches for a store whose race let two racers win.
    let dir = PathBuf::from(std::env::var_os("XDG_CACHE_HOME").unwrap())
        .join("torch-compiled-graphs-fleet-doctor");
    std::fs::create_dir_all(&dir).unwrap();
    use sha2::Digest as _;
    let name = hex::encode(sha2::Sha256::digest(url.as_bytes()));
    std::fs::write(dir.join(format!("{name}.json")), br#"{"qualified":false}"#).unwrap();
    assert_eq!(tcg_remote::doctor::cached_verdict(&url), Some(false));
    assert!(matches!(remote(&url).begin_flight(KEY), Flight::Solo));
}
