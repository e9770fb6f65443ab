//! The trust policy on the fleet tier against a real S3 server (moto, as in
//! moto.rs): signature records on the remote (layout, create-only, bounds),
//! trusting workers that ignore an untrusted ref and reuse a signed artifact,
//! hostile records, push/pull of records, and `fleet gc`/`fsck` over them.
//! Keys are made by the real `ssh-keygen`.

#[path = "../../tcg-core/tests/common/mod.rs"]
mod common;
mod support;

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{counting_mint, divergent_envelope, keygen, reference, KEY};
use support::{moto_as_default_endpoint, request, stat};
use tcg_cas::Digest;
use tcg_core::engine::{Engine, EnsureOutcome, RemoteTier, Source, StoreOutcome, TrustSettings};
use tcg_core::Code;
use tcg_remote::signatures::{put_record, MAX_RECORDS_PER_SIGNER, MAX_RECORD_BYTES};
use tcg_remote::{Remote, RemoteConfig};
use tcg_trust::{Signer, Subject};

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

/// A fleet: a bucket, a signing key K and another key J, and an
/// `allowed_signers` file listing K only.
struct Fleet {
    dir: tempfile::TempDir,
    url: String,
    k: PathBuf,
    j: PathBuf,
    allowed: PathBuf,
}

fn fleet() -> Fleet {
    let dir = tempfile::tempdir().unwrap();
    let (k, k_pub) = keygen(dir.path(), "k", "ci@fleet");
    let (j, _) = keygen(dir.path(), "j", "ci@fleet");
    let allowed = dir.path().join("allowed_signers");
    std::fs::write(&allowed, format!("ci@fleet {k_pub}\n")).unwrap();
    Fleet {
        url: bucket(),
        dir,
        k,
        j,
        allowed,
    }
}

impl Fleet {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn engine(&self, name: &str, signing: Option<&Path>, trust: bool) -> Engine {
        let config = TrustSettings {
            signing_key: signing.map(Path::to_path_buf),
            trust: trust.then(|| self.allowed.clone()),
            ..TrustSettings::default()
        }
        .load()
        .unwrap();
        Engine::open(self.path(name))
            .unwrap()
            .with_trust(config)
            .with_remote(remote(&self.url))
    }

    fn fp(&self, key: &Path) -> String {
        tcg_trust::fingerprint_hex(Signer::from_file(key).unwrap().public_key())
    }

    /// An untrusted writer (no signing key) publishes first: a second,
    /// valid artifact of KEY. Returns its manifest.
    fn untrusted_first(&self) -> Digest {
        let u = self.engine("untrusted", None, false);
        let m = u
            .import_artifact(KEY, &divergent_envelope(&self.path("")))
            .unwrap();
        let r = remote(&self.url);
        let rows = tcg_remote::ops::push(&u, &r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
        assert_eq!(
            rows.as_array().unwrap()[0].as_object().unwrap()["outcome"].as_str(),
            Some("STORED")
        );
        Digest::from_hex(&m.manifest).unwrap()
    }

    fn ensure(&self, e: &Engine, name: &str) -> (tcg_core::engine::EnsureResult, u32) {
        let calls = Cell::new(0);
        let work = self.path(&format!("work-{name}"));
        std::fs::create_dir_all(&work).unwrap();
        let mut mint = counting_mint(&calls, &work);
        let r = e
            .ensure(
                KEY,
                &self.path(&format!("graph-{name}")),
                &request(),
                &mut mint,
            )
            .unwrap();
        (r, calls.get())
    }
}

fn listed(r: &Remote, folder: &str) -> Vec<String> {
    let c = r.client().unwrap();
    c.list(&r.layout().folder(folder), 10_000)
        .unwrap()
        .into_iter()
        .map(|m| m.location.to_string())
        .collect()
}

fn toolchain_axis() -> String {
    let md = tcg_core::artifact::read_metadata(&reference()).unwrap();
    tcg_core::identity::toolchain_axis(md.toolchain())
}

/// A record by `key_file` about (`key`, `envelope`), as the remote stores it.
fn record(key_file: &Path, key: &str, envelope: &str) -> Vec<u8> {
    let s = Signer::from_file(key_file).unwrap();
    let subject = Subject {
        key: key.to_string(),
        envelope_sha256: envelope.to_string(),
        toolchain: toolchain_axis(),
    };
    let statement = s.statement(&subject, "ci@fleet", tcg_trust::unix_now());
    s.sign(&statement).unwrap().to_bytes()
}

#[test]
fn records_are_wire_named_create_only_and_read_bounded() {
    let f = fleet();
    let r = remote(&f.url);
    let c = r.client().unwrap();
    let fp = f.fp(&f.k);
    let m = Digest::of(b"some manifest");
    let rec = record(&f.k, KEY, &"ab".repeat(32));
    let name = r.layout().signature(KEY, &fp, &m, &rec).to_string();
    let (_, prefix) = tcg_remote::client::split_url(&f.url);
    assert_eq!(
        name,
        format!(
            "{prefix}/tcg/v1/signatures/{KEY}/{fp}/{}/{}",
            m.to_hex(),
            Digest::of(&rec).to_hex()
        )
    );
    assert!(put_record(c, r.layout(), KEY, &fp, &m, &rec).unwrap());
    // An identical record is fine; nothing is rewritten.
    assert!(!put_record(c, r.layout(), KEY, &fp, &m, &rec).unwrap());
    // A squatter at the name of a record not yet written: its bytes do not
    // hash to the name, so they are proven junk and the real record replaces them.
    let later = record(&f.k, KEY, &"cd".repeat(32));
    let squat = r.layout().signature(KEY, &fp, &m, &later);
    c.put(
        &squat,
        Bytes::from_static(b"junk"),
        object_store::PutMode::Overwrite,
    )
    .unwrap();
    assert!(put_record(c, r.layout(), KEY, &fp, &m, &later).unwrap());
    assert_eq!(
        c.get_small(&squat, 1 << 16).unwrap().0.as_ref(),
        later.as_slice()
    );
    c.delete(&squat).unwrap();
    // Junk at the name of a record nobody writes: read, and skipped.
    let never = record(&f.k, KEY, &"ef".repeat(32));
    let squat = r.layout().signature(KEY, &fp, &m, &never);
    c.put(
        &squat,
        Bytes::from_static(b"junk"),
        object_store::PutMode::Overwrite,
    )
    .unwrap();
    // Hostile names and sizes are skipped with a reason, never fatal.
    let junk_name = r
        .layout()
        .folder(&format!("signatures/{KEY}/{fp}/not-hex/x"));
    c.put(
        &junk_name,
        Bytes::from_static(b"{}"),
        object_store::PutMode::Overwrite,
    )
    .unwrap();
    let big = vec![b' '; MAX_RECORD_BYTES as usize + 1];
    let big_name = r.layout().signature(KEY, &fp, &m, &big);
    c.put(
        &big_name,
        Bytes::from(big),
        object_store::PutMode::Overwrite,
    )
    .unwrap();
    let found = r
        .signature_records(KEY, Some(std::slice::from_ref(&fp)))
        .unwrap();
    assert_eq!(found.ref_manifest, None);
    assert_eq!(found.records.len(), 1, "{:?}", found.skipped);
    assert_eq!(found.records[0].record, rec);
    assert_eq!(found.records[0].manifest, m);
    assert_eq!(found.skipped.len(), 3, "{:?}", found.skipped);
    assert!(found
        .skipped
        .iter()
        .any(|s| s.contains("does not hash to its name")));
    assert!(found.skipped.iter().any(|s| s.contains("over the limit")));
    assert!(found
        .skipped
        .iter()
        .any(|s| s.contains("not a signature record's name")));
    // Another signer's prefix is never read.
    let other = r.signature_records(KEY, Some(&[f.fp(&f.j)])).unwrap();
    assert!(other.records.is_empty() && other.skipped.is_empty());
    // Bounded per signer: a flood is capped and says so.
    for i in 0..MAX_RECORDS_PER_SIGNER {
        let body = format!("flood {i}").into_bytes();
        c.put(
            &r.layout().signature(KEY, &fp, &m, &body),
            Bytes::from(body),
            object_store::PutMode::Overwrite,
        )
        .unwrap();
    }
    let capped = r.signature_records(KEY, Some(&[fp])).unwrap();
    assert!(capped.records.len() + capped.skipped.len() <= MAX_RECORDS_PER_SIGNER + 1);
    assert!(capped
        .skipped
        .iter()
        .any(|s| s.contains("the rest are not read")));
}

#[test]
fn trusting_workers_ignore_an_untrusted_ref_mint_once_and_reuse_the_signed_artifact() {
    let f = fleet();
    let m0 = f.untrusted_first();
    // The first trusting worker (it signs): the ref's artifact is unsigned,
    // so it compiles, loses the ref and writes its signature record.
    let t1 = f.engine("t1", Some(&f.k), true);
    let (first, calls) = f.ensure(&t1, "t1");
    assert_eq!(calls, 1);
    assert_eq!(first.outcome, EnsureOutcome::Minted);
    assert_eq!(first.resolved.source, Source::Compiled);
    let publication = first.remote_publication.clone().unwrap();
    assert_eq!(publication.outcome, StoreOutcome::Divergent);
    assert_eq!(publication.manifest, m0.to_hex());
    let m1 = first.resolved.manifest.clone();
    assert_ne!(m1, m0.to_hex());
    // (ensure looks twice on a miss: before and under its lock.)
    assert!(stat(&t1, "remote_trust_refused") >= 1);
    assert_eq!(stat(&t1, "remote_reports"), 0);
    let r = remote(&f.url);
    let records = listed(&r, &format!("signatures/{KEY}/{}", f.fp(&f.k)));
    assert_eq!(records.len(), 1, "{records:?}");
    assert!(records[0].contains(&format!("/{m1}/")));
    // Other trusting workers (one signs too, one only trusts) reuse it.
    for (name, signing) in [("t2", Some(f.k.as_path())), ("t3", None)] {
        let t = f.engine(name, signing, true);
        let (got, calls) = f.ensure(&t, name);
        assert_eq!(calls, 0, "{name} compiled");
        assert_eq!(got.outcome, EnsureOutcome::Reused);
        assert_eq!(got.resolved.source, Source::Remote);
        assert_eq!(got.resolved.manifest, m1);
        // Its signature came along into the local store.
        assert_eq!(t.signers(KEY).unwrap().len(), 1);
        assert_eq!(stat(&t, "remote_hits"), 1);
    }
    // A worker without a policy keeps following the ref.
    let n = f.engine("n", None, false);
    let (got, calls) = f.ensure(&n, "n");
    assert_eq!(calls, 0);
    assert_eq!(got.resolved.source, Source::Remote);
    assert_eq!(got.resolved.manifest, m0.to_hex());
    // gc keeps the signed artifact beside the untrusted ref (grace 0).
    let report = tcg_remote::ops::gc(&r, Duration::ZERO, &mut |_, _| {}).unwrap();
    let o = report.as_object().unwrap();
    assert_eq!(o["signed_roots"], tcg_cj::Value::Int(1));
    let t4 = f.engine("t4", None, true);
    let (after_gc, calls) = f.ensure(&t4, "t4");
    assert_eq!((calls, after_gc.resolved.source), (0, Source::Remote));
    assert_eq!(after_gc.resolved.manifest, m1);
    let (fsck, clean) = tcg_remote::ops::fsck(&r, false).unwrap();
    assert!(clean, "{fsck:?}");
    assert_eq!(
        fsck.as_object().unwrap()["signatures_checked"],
        tcg_cj::Value::Int(1)
    );
}

#[test]
fn hostile_records_under_an_allowed_prefix_are_skipped_or_refused_never_served() {
    let f = fleet();
    let m0 = f.untrusted_first();
    let r = remote(&f.url);
    let c = r.client().unwrap();
    let fp = f.fp(&f.k);
    let plant = |body: &[u8]| {
        c.put(
            &r.layout().signature(KEY, &fp, &m0, body),
            Bytes::copy_from_slice(body),
            object_store::PutMode::Overwrite,
        )
        .unwrap();
    };
    // Junk, a record signed by another key, one about another key, and a
    // genuine K record about another envelope filed under the ref's manifest.
    plant(b"{\"not\":\"a record\"}");
    plant(&record(&f.j, KEY, &"ab".repeat(32)));
    let other_key = format!("{}0", &KEY[..KEY.len() - 1]);
    let other_key = if other_key == KEY {
        format!("{}1", &KEY[..KEY.len() - 1])
    } else {
        other_key
    };
    plant(&record(&f.k, &other_key, &"ab".repeat(32)));
    plant(&record(&f.k, KEY, &"ab".repeat(32)));
    let t = f.engine("t", None, true);
    assert!(t.resolve(KEY, &f.path("g")).unwrap().is_none());
    assert_eq!(stat(&t, "remote_signatures_skipped"), 3);
    assert_eq!(stat(&t, "remote_trust_refused"), 1);
    // Refusals are not evidence of bad bytes, and nothing was published.
    assert_eq!(stat(&t, "remote_reports"), 0);
    assert!(listed(&r, "reports").is_empty());
    assert!(t
        .store()
        .get_ref(&tcg_core::engine::graph_ref(KEY))
        .unwrap()
        .is_none());
    // A trusting worker that signs compiles, and its record is found next.
    let s = f.engine("s", Some(&f.k), true);
    let (minted, calls) = f.ensure(&s, "s");
    assert_eq!((calls, minted.outcome), (1, EnsureOutcome::Minted));
    let (reused, calls) = f.ensure(&t, "t");
    assert_eq!((calls, reused.resolved.source), (0, Source::Remote));
    assert_eq!(reused.resolved.manifest, minted.resolved.manifest);
    // fsck names the four hostile records; gc still sweeps (junk is no root).
    let (fsck, clean) = tcg_remote::ops::fsck(&r, false).unwrap();
    assert!(!clean);
    let bad = fsck.as_object().unwrap()["bad_signatures"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(bad.len(), 4, "{fsck:?}");
    tcg_remote::ops::gc(&r, Duration::ZERO, &mut |_, _| {}).unwrap();
}

#[test]
fn push_uploads_records_and_pull_admits_them_under_the_policy() {
    let f = fleet();
    let a = f.engine("a", None, false);
    a.import_artifact(KEY, &reference()).unwrap();
    a.sign_stored(KEY, &Signer::from_file(&f.k).unwrap(), Some("ci@fleet"))
        .unwrap();
    let r = remote(&f.url);
    let rows = tcg_remote::ops::push(&a, &r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
    let row = rows.as_array().unwrap()[0].as_object().unwrap().clone();
    assert_eq!(row["signatures"], tcg_cj::Value::Int(1), "{rows:?}");
    let keys = [KEY.to_string()];
    // A trusting store pulls it with its record.
    let p = f.engine("p", None, true);
    let pulled = tcg_remote::ops::pull(&p, &keys, false, &mut |_, _| {}).unwrap();
    let row = pulled.as_array().unwrap()[0].as_object().unwrap().clone();
    assert_eq!(row["source"].as_str(), Some("remote"), "{pulled:?}");
    assert_eq!(row["signatures"], tcg_cj::Value::Int(1));
    assert_eq!(p.signers(KEY).unwrap().len(), 1);
    // A store trusting only J refuses it with its code; nothing is stored.
    let j_pub = std::fs::read_to_string(format!("{}.pub", f.j.display())).unwrap();
    let only_j = f.path("only_j");
    std::fs::write(&only_j, format!("ci@fleet {}", j_pub.trim())).unwrap();
    let q = Engine::open(f.path("q"))
        .unwrap()
        .with_trust(
            TrustSettings {
                trust: Some(only_j),
                ..TrustSettings::default()
            }
            .load()
            .unwrap(),
        )
        .with_remote(remote(&f.url));
    let pulled = q.pull_key(KEY, true).unwrap();
    assert_eq!(pulled.source, None);
    assert_eq!(pulled.refused.unwrap().code(), Code::TrustUnsigned);
    assert!(q
        .store()
        .get_ref(&tcg_core::engine::graph_ref(KEY))
        .unwrap()
        .is_none());
    // Without a policy, records are stored as received (those that verify).
    let n = f.engine("n", None, false);
    let pulled = n.pull_key(KEY, false).unwrap();
    assert_eq!(
        (pulled.source, pulled.signatures),
        (Some(Source::Remote), 1)
    );
    assert_eq!(n.signers(KEY).unwrap().len(), 1);
    // The signed record's chunk gone from the remote: a trusting store's
    // pull is a miss, counted once, with no error and no report.
    let c = r.client().unwrap();
    let l = r.layout();
    let (rb, _) = c.get_small(&l.graph_ref(KEY), 4096).unwrap();
    let rec = tcg_remote::RefRecord::parse(&rb).unwrap();
    let (mb, _) = c.get_small(&l.manifest(&rec.manifest), 1 << 20).unwrap();
    let man = tcg_cas::Manifest::parse(&mb, &rec.manifest).unwrap();
    c.delete(&l.chunk(&man.chunks[0].digest)).unwrap();
    let m = f.engine("m", None, true);
    let pulled = m.pull_key(KEY, false).unwrap();
    assert_eq!((pulled.source, pulled.refused.is_none()), (None, true));
    assert_eq!(
        (
            stat(&m, "remote_misses"),
            stat(&m, "remote_errors"),
            stat(&m, "remote_reports")
        ),
        (1, 0, 0)
    );
}
