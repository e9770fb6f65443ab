//! The fleet tier against a hostile remote and a hostile writer (issue 25):
//! a scripted hostile S3 server and a counting, rewriting proxy in front of
//! the real S3 test server (moto), both on free loopback ports started and
//! stopped by the tests. What is pinned: listings never end early without
//! saying so and `fleet gc` never deletes on one; every body the client
//! reads is capped and every exchange has its deadline; the resolve path's
//! listings are bounded by the metadata timeout; trust is decided from the
//! manifest and statements before any chunk GET; manifests that repeat
//! chunks or declare too much are refused before the first GET; and one
//! unparseable name fails no listing.

#[path = "../../tcg-core/tests/common/mod.rs"]
mod common;
mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{divergent_envelope, keygen, reference, KEY};
use support::{bucket, moto_port, stat};
use tcg_cas::{Chunk, Digest, Manifest};
use tcg_core::engine::{Engine, RemoteError, RemoteTier, TrustSettings};
use tcg_core::Code;
use tcg_remote::{Remote, RemoteConfig};

fn remote_at(url: &str, port: u16, timeout: Duration) -> Arc<Remote> {
    let _ = moto_port(); // the credentials and plain HTTP of the test environment
    let mut c = RemoteConfig::new(url).unwrap();
    c.timeout = timeout;
    c.wait = Duration::from_secs(5);
    c.lease_ttl = Duration::from_secs(3);
    c.options
        .push(("aws_endpoint".into(), format!("http://127.0.0.1:{port}")));
    Arc::new(Remote::new(c).unwrap())
}

fn remote(url: &str) -> Arc<Remote> {
    remote_at(url, moto_port(), Duration::from_secs(10))
}

// ---------------------------------------------------------------------------
// A small HTTP/1.1 toolkit: read a request head, answer, forward.

struct Req {
    method: String,
    target: String,
    head: Vec<u8>,
    body: Vec<u8>,
}

fn read_request(conn: &mut TcpStream) -> Option<Req> {
    let mut data = Vec::new();
    let mut buf = [0u8; 65536];
    let (head, mut body) = loop {
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = data.split_off(i + 4);
            break (data, rest);
        }
        let n = conn.read(&mut buf).ok()?;
        if n == 0 || data.len() > 1 << 20 {
            return None;
        }
        data.extend_from_slice(&buf[..n]);
    };
    let text = String::from_utf8_lossy(&head).to_string();
    let len: usize = text
        .lines()
        .skip(1)
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while body.len() < len {
        let n = conn.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&buf[..n]);
    }
    let mut first = text.lines().next()?.split(' ');
    Some(Req {
        method: first.next()?.to_string(),
        target: first.next()?.to_string(),
        head,
        body,
    })
}

fn answer(conn: &mut TcpStream, status: u16, body: &[u8]) {
    let _ = write!(
        conn,
        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nContent-Type: application/xml\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = conn.write_all(body);
}

const NO_SUCH_KEY: &[u8] =
    b"<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code><Message>no</Message></Error>";

/// Forward `req` to moto and return (status line + headers, body).
fn forward(req: &Req) -> Option<(String, Vec<u8>)> {
    let mut up = TcpStream::connect(("127.0.0.1", moto_port())).ok()?;
    let text = String::from_utf8_lossy(&req.head).to_string();
    let mut fwd = String::new();
    for (i, l) in text.trim_end().lines().enumerate() {
        let is_conn = l
            .split_once(':')
            .is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case("connection"));
        if i == 0 || !is_conn {
            fwd.push_str(l);
            fwd.push_str("\r\n");
        }
    }
    fwd.push_str("Connection: close\r\n\r\n");
    up.write_all(fwd.as_bytes()).ok()?;
    up.write_all(&req.body).ok()?;
    let mut all = Vec::new();
    up.read_to_end(&mut all).ok()?;
    let i = all.windows(4).position(|w| w == b"\r\n\r\n")?;
    let body = all.split_off(i + 4);
    Some((String::from_utf8_lossy(&all).to_string(), body))
}

fn send_forwarded(conn: &mut TcpStream, method: &str, rhead: &str, body: &[u8]) {
    let mut out = String::new();
    let mut declared = body.len().to_string();
    for (i, l) in rhead.trim_end().lines().enumerate() {
        let name = l
            .split_once(':')
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()));
        match name {
            Some((k, v)) if k == "content-length" && method == "HEAD" => declared = v,
            Some((k, _))
                if matches!(
                    k.as_str(),
                    "connection" | "content-length" | "transfer-encoding"
                ) => {}
            _ if i == 0 || name.is_some() => {
                out.push_str(l);
                out.push_str("\r\n");
            }
            _ => {}
        }
    }
    out.push_str(&format!(
        "Content-Length: {declared}\r\nConnection: close\r\n\r\n"
    ));
    let _ = conn.write_all(out.as_bytes());
    let _ = conn.write_all(body);
}

/// A server on a free loopback port, one thread a connection, that hands
/// every request to `handle`; stopped when dropped.
struct Server {
    port: u16,
    stop: Arc<AtomicBool>,
}

impl Server {
    fn start(handle: impl Fn(Req, TcpStream) + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let handle = Arc::new(handle);
        let s = Arc::clone(&stop);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(mut conn) = conn else { return };
                let h = Arc::clone(&handle);
                std::thread::spawn(move || {
                    if let Some(req) = read_request(&mut conn) {
                        h(req, conn);
                    }
                });
            }
        });
        Server { port, stop }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// A proxy in front of moto counting GETs (not listings) whose target
/// contains "/chunks/".
fn counting_proxy() -> (Server, Arc<AtomicU32>) {
    let gets = Arc::new(AtomicU32::new(0));
    let g = Arc::clone(&gets);
    let server = Server::start(move |req, mut conn| {
        if req.method == "GET"
            && req.target.contains("/chunks/")
            && !req.target.contains("list-type")
        {
            g.fetch_add(1, Ordering::SeqCst);
        }
        if let Some((head, body)) = forward(&req) {
            send_forwarded(&mut conn, &req.method, &head, &body);
        }
    });
    (server, gets)
}

fn is_listing(req: &Req) -> bool {
    req.method == "GET" && req.target.contains("list-type=2")
}

/// `key` under the bucket of `url` as a raw, unsigned PUT to moto (a
/// hostile writer's names, which a client library would refuse to make).
fn raw_put(url: &str, key: &str, body: &[u8]) {
    let bucket = url.trim_start_matches("s3://").split('/').next().unwrap();
    let mut s = TcpStream::connect(("127.0.0.1", moto_port())).unwrap();
    write!(
        s,
        "PUT /{bucket}/{key} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{key}: {reply}");
}

fn names(r: &Remote, folder: &str) -> Vec<String> {
    r.client()
        .unwrap()
        .list(&r.layout().folder(folder), 100_000)
        .unwrap()
        .into_iter()
        .map(|m| m.location.to_string())
        .collect()
}

/// The reference published by a plain engine on `url`; returns its manifest.
fn published(dir: &Path, url: &str) -> Digest {
    let r = remote(url);
    let a = Engine::open(dir.join("a")).unwrap().with_remote(r.clone());
    let m = a.import_artifact(KEY, &reference()).unwrap();
    tcg_remote::ops::push(&a, &r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
    Digest::from_hex(&m.manifest).unwrap()
}

fn int(v: &tcg_cj::Value, name: &str) -> i64 {
    match v.as_object().unwrap()[name] {
        tcg_cj::Value::Int(n) => n,
        ref other => panic!("{name} is {other:?}"),
    }
}

// ---------------------------------------------------------------------------
// 1. fleet gc never deletes on a truncated or failed listing.

/// A worker credential adds more names than the listing cap: gc refuses
/// (`remote.listing_incomplete`), says how to proceed, and deletes nothing.
/// With the cap raised it runs and keeps the published artifact.
#[test]
fn gc_refuses_a_listing_past_the_cap_and_deletes_nothing() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let m = published(d.path(), &url);
    let r = remote(&url);
    let c = r.client().unwrap();
    // Names sorting before anything real, in every folder gc reads.
    for folder in ["refs", "signatures", "chunks", "manifests"] {
        for i in 0..60 {
            let p = r.layout().folder(&format!("{folder}/0000-junk-{i:04}"));
            c.create(&p, Bytes::from_static(b"x")).unwrap();
        }
    }
    std::thread::sleep(Duration::from_millis(1100));
    let before: Vec<Vec<String>> = ["chunks", "manifests"]
        .iter()
        .map(|f| names(&r, f))
        .collect();
    let mut config = r.config().clone();
    config.list_cap = 50;
    let capped = Remote::new(config).unwrap();
    let err = tcg_remote::ops::gc(&capped, Duration::ZERO, &mut |_, _| {}).unwrap_err();
    assert_eq!(err.code(), Code::RemoteListingIncomplete, "{err}");
    assert!(err.message().contains("nothing was changed"), "{err}");
    assert!(
        err.message()
            .contains("TORCH_COMPILED_GRAPHS_REMOTE_LIST_CAP"),
        "{err}"
    );
    let after: Vec<Vec<String>> = ["chunks", "manifests"]
        .iter()
        .map(|f| names(&r, f))
        .collect();
    assert_eq!(before, after);
    // A cap the bucket fits in: the sweep runs; the ref's artifact stays.
    let swept = tcg_remote::ops::gc(&r, Duration::ZERO, &mut |_, _| {}).unwrap();
    assert_eq!(int(&swept, "refs"), 1);
    assert!(names(&r, "manifests").contains(&r.layout().manifest(&m).to_string()));
    let (report, _) = tcg_remote::ops::fsck(&r, true).unwrap();
    assert_eq!(
        report.as_object().unwrap()["bad"],
        tcg_cj::Value::Array(vec![])
    );
}

/// A server whose listing of `refs/` claims more names without a
/// continuation token: before, gc took it as complete (no refs) and swept
/// the published artifact; now it refuses and deletes nothing.
#[test]
fn gc_refuses_a_listing_that_claims_truncation_without_a_token() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let m = published(d.path(), &url);
    std::thread::sleep(Duration::from_millis(1100));
    let proxy = Server::start(|req, mut conn| {
        if is_listing(&req) && req.target.contains("refs") {
            answer(
                &mut conn,
                200,
                b"<?xml version=\"1.0\"?><ListBucketResult><IsTruncated>true</IsTruncated><KeyCount>0</KeyCount></ListBucketResult>",
            );
            return;
        }
        if let Some((head, body)) = forward(&req) {
            send_forwarded(&mut conn, &req.method, &head, &body);
        }
    });
    let hostile = remote_at(&url, proxy.port, Duration::from_secs(10));
    let err = tcg_remote::ops::gc(&hostile, Duration::ZERO, &mut |_, _| {}).unwrap_err();
    assert_eq!(err.code(), Code::RemoteUnavailable, "{err}");
    assert!(err.message().contains("continuation token"), "{err}");
    assert!(err.message().contains("nothing was changed"), "{err}");
    let r = remote(&url);
    assert!(names(&r, "manifests").contains(&r.layout().manifest(&m).to_string()));
    let (_, clean) = tcg_remote::ops::fsck(&r, true).unwrap();
    assert!(clean);
}

// ---------------------------------------------------------------------------
// 2. Every body is capped; every exchange has its deadline.

/// Answers every request with a 500 whose declared body is 1 GiB, streamed
/// until the client goes; counts the bytes it managed to send.
fn huge_error_server(sent: Arc<AtomicU64>) -> Server {
    Server::start(move |_req, mut conn| {
        let total: u64 = 1 << 30;
        let _ = write!(
            conn,
            "HTTP/1.1 500 Internal Error\r\nContent-Length: {total}\r\nContent-Type: application/xml\r\nConnection: close\r\n\r\n<Error><Code>InternalError</Code><Message>"
        );
        let block = vec![b'A'; 64 * 1024];
        let mut n = 0u64;
        while n < total {
            match conn.write(&block) {
                Ok(0) | Err(_) => break,
                Ok(k) => {
                    n += k as u64;
                    sent.fetch_add(k as u64, Ordering::SeqCst);
                }
            }
        }
    })
}

#[test]
fn a_huge_error_body_is_cut_in_the_http_layer() {
    let sent = Arc::new(AtomicU64::new(0));
    let server = huge_error_server(Arc::clone(&sent));
    let r = remote_at("s3://hostile/p", server.port, Duration::from_secs(3));
    let t = Instant::now();
    let err = r.open(KEY).unwrap_err();
    let took = t.elapsed();
    let RemoteError::Unavailable(msg) = &err else {
        panic!("{err:?}");
    };
    assert!(msg.contains("500"), "{msg}");
    // A message, not a dump: the client kept at most a few KiB of the body.
    assert!(msg.len() < 16 * 1024, "{} bytes of message", msg.len());
    // The server could push no more than the sockets' buffers take: far
    // from the 1 GiB it offered (three answers: the first try, two retries).
    let pushed = sent.load(Ordering::SeqCst);
    assert!(pushed < 64 << 20, "the server sent {pushed} bytes");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

/// The CLI on the same server: bounded stderr (the 1 GiB body is never printed).
#[test]
fn the_cli_prints_a_bounded_line_for_a_huge_error_body() {
    let sent = Arc::new(AtomicU64::new(0));
    let server = huge_error_server(Arc::clone(&sent));
    let d = tempfile::tempdir().unwrap();
    let _ = moto_port();
    let cli = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/debug/torch-compiled-graphs");
    if !cli.exists() {
        // Built by `cargo build` / `make`: a missing binary is a failure, not a skip.
        panic!("{} is missing: build the workspace first", cli.display());
    }
    let out = std::process::Command::new(&cli)
        .args(["fleet", "ls", "--remote", "s3://hostile/p", "--cas-root"])
        .arg(d.path().join("store"))
        .env("AWS_ENDPOINT", format!("http://127.0.0.1:{}", server.port))
        .env("TORCH_COMPILED_GRAPHS_REMOTE_TIMEOUT_S", "3")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        out.stderr.len() < 32 * 1024,
        "{} bytes on stderr",
        out.stderr.len()
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("code: remote.unavailable"));
    assert!(sent.load(Ordering::SeqCst) < 64 << 20);
}

/// A body dripped a byte at a time (error or success): the exchange ends at
/// its deadline, headers and body together.
#[test]
fn a_slow_drip_body_ends_at_the_deadline() {
    for status in [500u16, 200] {
        let server = Server::start(move |_req, mut conn| {
            let _ = write!(
                conn,
                "HTTP/1.1 {status} X\r\nContent-Length: 1000\r\nETag: \"e\"\r\nLast-Modified: Tue, 01 Dec 2026 00:00:00 GMT\r\nConnection: close\r\n\r\n"
            );
            for _ in 0..1000 {
                if conn.write_all(b"{").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let r = remote_at("s3://hostile/p", server.port, Duration::from_secs(1));
        let t = Instant::now();
        let err = r.open(KEY).unwrap_err();
        let took = t.elapsed();
        assert!(
            matches!(err, RemoteError::Unavailable(_)),
            "{status}: {err:?}"
        );
        // 1000 bytes at 10 a second would take 100 s.
        assert!(took < Duration::from_secs(20), "{status}: {took:?}");
    }
}

// ---------------------------------------------------------------------------
// 3. Listings on the resolve path are bounded by the metadata timeout.

#[test]
fn a_slow_signature_listing_is_bounded_by_the_metadata_timeout() {
    let listings = Arc::new(AtomicU32::new(0));
    let l = Arc::clone(&listings);
    let server = Server::start(move |req, mut conn| {
        if is_listing(&req) {
            l.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_secs(90));
            return;
        }
        answer(&mut conn, 404, NO_SUCH_KEY);
    });
    let r = remote_at("s3://hostile/p", server.port, Duration::from_secs(1));
    let fp = "ab".repeat(32);
    let t = Instant::now();
    let err = r
        .signature_records(KEY, Some(std::slice::from_ref(&fp)))
        .unwrap_err();
    assert!(matches!(err, RemoteError::Unavailable(_)), "{err:?}");
    // Was 60 metadata timeouts (60 s here).
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert!(listings.load(Ordering::SeqCst) >= 1);
    // A trusting follower's wait polls the same listing: each poll is bounded too.
    let t = Instant::now();
    let mut c = r.config().clone();
    c.wait = Duration::from_secs(2);
    let follower = Remote::new(c).unwrap();
    assert!(!follower.await_signed(KEY, std::slice::from_ref(&fp)));
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}

// ---------------------------------------------------------------------------
// 4. Trust is decided from the manifest and statements before any chunk GET.

#[test]
fn a_genuine_record_copied_under_another_manifest_is_refused_with_no_chunk_get() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let (k, k_pub) = keygen(d.path(), "k", "ci@fleet");
    let allowed = d.path().join("allowed_signers");
    std::fs::write(&allowed, format!("ci@fleet {k_pub}\n")).unwrap();
    let r = remote(&url);
    // An untrusted writer publishes artifact B (its ref, manifest, chunks).
    let u = Engine::open(d.path().join("u")).unwrap();
    let b = u
        .import_artifact(KEY, &divergent_envelope(d.path()))
        .unwrap();
    tcg_remote::ops::push(&u, &r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
    let b = Digest::from_hex(&b.manifest).unwrap();
    // K signs artifact A locally; its genuine record is copied under B's name.
    let signer = Engine::open(d.path().join("s")).unwrap();
    signer.import_artifact(KEY, &reference()).unwrap();
    signer
        .sign_stored(
            KEY,
            &tcg_trust::Signer::from_file(&k).unwrap(),
            Some("ci@fleet"),
        )
        .unwrap();
    let (_, records) = signer.remote_signature_records(KEY).unwrap().unwrap();
    assert_eq!(records.len(), 1);
    let (fp, rec) = &records[0];
    let c = r.client().unwrap();
    assert!(tcg_remote::signatures::put_record(c, r.layout(), KEY, fp, &b, rec).unwrap());

    let (proxy, chunk_gets) = counting_proxy();
    let w = Engine::open(d.path().join("w"))
        .unwrap()
        .with_trust(
            TrustSettings {
                trust: Some(allowed.clone()),
                ..TrustSettings::default()
            }
            .load()
            .unwrap(),
        )
        .with_remote(remote_at(&url, proxy.port, Duration::from_secs(10)));
    let pulled = w.pull_key(KEY, false).unwrap();
    let refused = pulled.refused.expect("refused");
    assert_eq!(refused.code(), Code::TrustStatementMismatch, "{refused}");
    assert_eq!(chunk_gets.load(Ordering::SeqCst), 0);
    assert!(pulled.source.is_none());
    assert_eq!(stat(&w, "remote_reports"), 0); // unsigned is not corrupt
}

// ---------------------------------------------------------------------------
// 5. Manifests that repeat chunks or declare too much: refused before the first GET.

fn plant_manifest(r: &Remote, manifest: &Manifest) -> Digest {
    let bytes = manifest.to_bytes();
    let d = Digest::of(&bytes);
    let c = r.client().unwrap();
    c.create(&r.layout().manifest(&d), Bytes::from(bytes))
        .unwrap();
    let record = tcg_remote::RefRecord {
        key: KEY.to_string(),
        manifest: d,
        producer: "a hostile writer".into(),
        created: 0,
    };
    c.create(&r.layout().graph_ref(KEY), Bytes::from(record.to_bytes()))
        .unwrap();
    d
}

#[test]
fn manifests_repeating_chunks_or_over_the_limit_are_refused_before_any_get() {
    let full = tcg_cas::MAX_CHUNK_BYTES;
    let x = Digest::of(b"a 64 MiB chunk");
    let last = Chunk {
        digest: Digest::of(b"z"),
        len: 1,
    };
    let repeated = Manifest {
        file_digest: Digest::of(b"whole"),
        size: 150 * full + 1,
        chunks: std::iter::repeat_n(
            Chunk {
                digest: x,
                len: full,
            },
            150,
        )
        .chain([last])
        .collect(),
    };
    let too_big = Manifest {
        file_digest: Digest::of(b"whole"),
        size: 195 * full + 1,
        chunks: (0..195u32)
            .map(|i| Chunk {
                digest: Digest::of(&i.to_le_bytes()),
                len: full,
            })
            .chain([last])
            .collect(),
    };
    for (name, manifest, why) in [
        ("repeats", repeated, "distinct"),
        ("too big", too_big, "over the envelope limit"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let url = bucket();
        let r = remote(&url);
        let m = plant_manifest(&r, &manifest);
        let (proxy, chunk_gets) = counting_proxy();
        let w = Engine::open(d.path().join("w"))
            .unwrap()
            .with_remote(remote_at(&url, proxy.port, Duration::from_secs(10)));
        assert!(
            w.resolve(KEY, &d.path().join("g")).unwrap().is_none(),
            "{name}"
        );
        assert_eq!(chunk_gets.load(Ordering::SeqCst), 0, "{name}");
        assert_eq!(stat(&w, "remote_reports"), 1, "{name}");
        let err =
            tcg_remote::fetch::read_manifest(r.client().unwrap(), r.layout(), &m).unwrap_err();
        assert!(format!("{err}").contains(why), "{name}: {err}");
    }
}

// ---------------------------------------------------------------------------
// 6. One unparseable name fails no listing; fsck names it.

#[test]
fn unparseable_names_are_skipped_per_entry_and_named_by_fsck() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let m = published(d.path(), &url);
    let (_, prefix) = tcg_remote::client::split_url(&url);
    let root = format!("{prefix}/tcg/v1");
    let fp = "ab".repeat(32);
    let hostile = [
        format!("{root}/refs//{KEY}"),
        format!("{root}/refs/x/../{KEY}"),
        format!("{root}/refs/not-a-key"),
        format!("{root}/refs/{KEY}/nested"),
        format!("{root}/signatures/{KEY}/{fp}//junk"),
        format!("{root}/chunks//junk"),
        format!("{root}/manifests/./junk"),
    ];
    for name in &hostile {
        raw_put(&url, name, b"{}");
    }
    let r = remote(&url);
    // fleet ls: the real ref, the rest skipped.
    let rows = tcg_remote::ops::ls(&r).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        rows[0].as_object().unwrap()["manifest"].as_str(),
        Some(m.to_hex().as_str())
    );
    // fleet fsck names every one of them, and is not clean.
    let (report, clean) = tcg_remote::ops::fsck(&r, false).unwrap();
    assert!(!clean);
    let o = report.as_object().unwrap();
    assert_eq!(o["bad"], tcg_cj::Value::Array(vec![]), "{report:?}");
    let named: Vec<String> = o["unparseable"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_object().unwrap()["name"].as_str().unwrap().to_string())
        .collect();
    for name in &hostile {
        assert!(named.contains(name), "{name} not in {named:?}");
    }
    // fleet gc sweeps (nothing of the real artifact), never deleting a skipped name.
    std::thread::sleep(Duration::from_millis(1100));
    let swept = tcg_remote::ops::gc(&r, Duration::ZERO, &mut |_, _| {}).unwrap();
    assert_eq!(int(&swept, "refs"), 1);
    assert!(int(&swept, "unparseable") >= 4, "{swept:?}");
    let (report, _) = tcg_remote::ops::fsck(&r, true).unwrap();
    assert_eq!(
        report.as_object().unwrap()["bad"],
        tcg_cj::Value::Array(vec![])
    );
    assert_eq!(
        report.as_object().unwrap()["unparseable"]
            .as_array()
            .unwrap()
            .len(),
        named.len()
    );
    // pull of every key (the CLI's `pull` without keys lists refs/).
    let keys = tcg_remote::ops::keys(&r).unwrap();
    assert_eq!(keys, vec![KEY.to_string()]);
    let w = Engine::open(d.path().join("w"))
        .unwrap()
        .with_remote(r.clone());
    let rows = tcg_remote::ops::pull(&w, &keys, false, &mut |_, _| {}).unwrap();
    assert_eq!(
        rows.as_array().unwrap()[0].as_object().unwrap()["source"].as_str(),
        Some("remote")
    );
}

/// A trusting fetch of a correctly signed artifact, with a hostile name in
/// its signer's listing: the record is read, the artifact admitted.
#[test]
fn a_trusting_fetch_works_beside_an_unparseable_name() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let (k, k_pub) = keygen(d.path(), "k", "ci@fleet");
    let allowed = d.path().join("allowed_signers");
    std::fs::write(&allowed, format!("ci@fleet {k_pub}\n")).unwrap();
    let r = remote(&url);
    let signer = Engine::open(d.path().join("s"))
        .unwrap()
        .with_remote(r.clone());
    signer.import_artifact(KEY, &reference()).unwrap();
    signer
        .sign_stored(
            KEY,
            &tcg_trust::Signer::from_file(&k).unwrap(),
            Some("ci@fleet"),
        )
        .unwrap();
    let rows = tcg_remote::ops::push(&signer, &r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
    assert_eq!(int(&rows.as_array().unwrap()[0], "signatures"), 1);
    let (fp, _) = signer.remote_signature_records(KEY).unwrap().unwrap().1[0].clone();
    let (_, prefix) = tcg_remote::client::split_url(&url);
    raw_put(
        &url,
        &format!("{prefix}/tcg/v1/signatures/{KEY}/{fp}//junk"),
        b"{}",
    );
    raw_put(
        &url,
        &format!("{prefix}/tcg/v1/signatures/{KEY}/{fp}/../junk"),
        b"{}",
    );
    let w = Engine::open(d.path().join("w"))
        .unwrap()
        .with_trust(
            TrustSettings {
                trust: Some(allowed),
                ..TrustSettings::default()
            }
            .load()
            .unwrap(),
        )
        .with_remote(r.clone());
    let pulled = w.pull_key(KEY, false).unwrap();
    assert!(pulled.refused.is_none(), "{:?}", pulled.refused);
    assert_eq!(pulled.source, Some(tcg_core::engine::Source::Remote));
    assert!(stat(&w, "remote_signatures_skipped") >= 1);
}

// ---------------------------------------------------------------------------
// 7. Repair replaces what verification proves wrong; the rest stays create-only.

fn outcome(v: &tcg_cj::Value) -> String {
    v.as_object().unwrap()["outcome"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn repair_replaces_a_malformed_ref_and_an_overwritten_chunk() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let r = remote(&url);
    let a = Engine::open(d.path().join("a"))
        .unwrap()
        .with_remote(r.clone());
    let m = a.import_artifact(KEY, &reference()).unwrap();
    let m = Digest::from_hex(&m.manifest).unwrap();
    tcg_remote::ops::push(&a, &r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
    let c = r.client().unwrap();

    // A malformed ref (a writer's junk): fetch refuses it, repair replaces it.
    let refp = r.layout().graph_ref(KEY);
    c.put(
        &refp,
        Bytes::from_static(b"{\"junk\":1}"),
        object_store::PutMode::Overwrite,
    )
    .unwrap();
    assert!(matches!(
        tcg_remote::fetch::read_ref(c, r.layout(), KEY),
        Err(RemoteError::Bad { .. })
    ));
    let fixed = tcg_remote::ops::repair(&a, &r, KEY).unwrap();
    assert_eq!(outcome(&fixed), "REPAIRED", "{fixed:?}");
    let now = tcg_remote::fetch::read_ref(c, r.layout(), KEY)
        .unwrap()
        .unwrap();
    assert_eq!(now.manifest, m);

    // An overwritten chunk, same length: push cannot tell (HEAD only), repair reads
    // it back, proves it wrong and replaces it.
    let manifest = tcg_remote::fetch::read_manifest(c, r.layout(), &m)
        .unwrap()
        .unwrap();
    let chunk = manifest.chunks[0];
    let cp = r.layout().chunk(&chunk.digest);
    let (good, _) = c.get_small(&cp, chunk.len).unwrap();
    let mut bad = good.to_vec();
    bad[10] ^= 0xff;
    c.put(&cp, Bytes::from(bad), object_store::PutMode::Overwrite)
        .unwrap();
    let (report, clean) = tcg_remote::ops::fsck(&r, true).unwrap();
    assert!(!clean, "{report:?}");
    let fixed = tcg_remote::ops::repair(&a, &r, KEY).unwrap();
    assert_eq!(outcome(&fixed), "REPAIRED", "{fixed:?}");
    assert_eq!(int(&fixed, "replaced_objects"), 1);
    assert_eq!(c.get_small(&cp, chunk.len).unwrap().0, good);
    let (report, clean) = tcg_remote::ops::fsck(&r, true).unwrap();
    assert!(clean, "{report:?}");
    // Nothing left to mend: present, nothing replaced.
    let again = tcg_remote::ops::repair(&a, &r, KEY).unwrap();
    assert_eq!(outcome(&again), "PRESENT", "{again:?}");
    assert_eq!(int(&again, "replaced_objects"), 0);
}

#[test]
fn push_and_repair_replace_an_overwritten_signature_record() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let (k, _) = keygen(d.path(), "k", "ci@fleet");
    let r = remote(&url);
    let a = Engine::open(d.path().join("a"))
        .unwrap()
        .with_remote(r.clone());
    let m = a.import_artifact(KEY, &reference()).unwrap();
    let m = Digest::from_hex(&m.manifest).unwrap();
    a.sign_stored(
        KEY,
        &tcg_trust::Signer::from_file(&k).unwrap(),
        Some("ci@fleet"),
    )
    .unwrap();
    tcg_remote::ops::push(&a, &r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
    let (_, records) = a.remote_signature_records(KEY).unwrap().unwrap();
    let (fp, rec) = &records[0];
    let c = r.client().unwrap();
    let at = r.layout().signature(KEY, fp, &m, rec);
    for (i, mend) in ["push", "repair"].iter().enumerate() {
        c.put(
            &at,
            Bytes::from(format!("overwritten {i}")),
            object_store::PutMode::Overwrite,
        )
        .unwrap();
        let (report, clean) = tcg_remote::ops::fsck(&r, false).unwrap();
        assert!(!clean, "{report:?}");
        let v = match *mend {
            "push" => {
                let rows =
                    tcg_remote::ops::push(&a, &r, &[KEY.to_string()], &mut |_, _| {}).unwrap();
                rows.as_array().unwrap()[0].clone()
            }
            _ => tcg_remote::ops::repair(&a, &r, KEY).unwrap(),
        };
        assert_eq!(int(&v, "signatures"), 1, "{mend}: {v:?}");
        assert_eq!(
            c.get_small(&at, 1 << 16).unwrap().0.as_ref(),
            rec.as_slice(),
            "{mend}"
        );
        let (report, clean) = tcg_remote::ops::fsck(&r, false).unwrap();
        assert!(clean, "{mend}: {report:?}");
    }
    // The same record again: nothing is rewritten.
    assert!(!tcg_remote::signatures::put_record(c, r.layout(), KEY, fp, &m, rec).unwrap());
}
