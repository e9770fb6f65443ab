//! Degrade, never break, on `ensure` (FLEET.md §5): every fault of the list,
//! injected by a small HTTP proxy between the engine and a real S3 server
//! (moto, started here on a free loopback port), costs at most a local
//! compile, never a failed `ensure`, with the same counters and evidence as
//! on `resolve` (tests/test_fleet.py covers `resolve` from Python). Also
//! `explain`'s remote presence, which a failing remote turns into "unknown".
//!
//! The mint is the cheap reference mint of the engine tests (no AOTInductor
//! compile): what is under test is the remote path around it.

#[path = "../../tcg-core/tests/common/mod.rs"]
mod common;
mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{counting_mint, reference, KEY};
use support::{bucket, free_port, moto_port, request, stat};
use tcg_cj::Value;
use tcg_core::engine::{Engine, EnsureOutcome, Source};
use tcg_remote::{Remote, RemoteConfig};

#[derive(Clone, Copy, Debug)]
enum Kind {
    Status(u16),
    Delay(Duration),
    Truncate,
    Corrupt,
    /// The first byte flipped: the envelope parser refuses it long before
    /// the chunk's end, where the stream checks the chunk's SHA-256.
    CorruptFirst,
    Reset,
}

/// What the proxy does to GET requests whose path contains `matching`.
#[derive(Clone, Copy, Debug)]
struct Fault {
    kind: Kind,
    matching: &'static str,
}

/// A loopback HTTP/1.1 proxy in front of moto, one request a connection
/// (`Connection: close`), that injects its fault into matching GETs.
struct FaultProxy {
    port: u16,
    hits: Arc<AtomicU32>,
}

fn read_head(conn: &mut TcpStream) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut data = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        if let Some(i) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = data.split_off(i + 4);
            return Some((data, rest));
        }
        let n = conn.read(&mut buf).ok()?;
        if n == 0 || data.len() > 1 << 20 {
            return None;
        }
        data.extend_from_slice(&buf[..n]);
    }
}

fn header(head: &[u8], name: &str) -> Option<String> {
    String::from_utf8_lossy(head).lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

/// Abort the connection with a TCP reset (SO_LINGER 0, then close).
fn reset(conn: TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket descriptor and a correctly sized option value.
    unsafe {
        libc::setsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    drop(conn);
}

fn handle(mut conn: TcpStream, upstream: u16, fault: Fault, hits: &AtomicU32) -> Option<()> {
    let (head, mut body) = read_head(&mut conn)?;
    let len: usize = header(&head, "content-length")
        .map_or(Ok(0), |v| v.parse())
        .ok()?;
    while body.len() < len {
        let mut buf = vec![0u8; (len - body.len()).min(1 << 20)];
        let n = conn.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head).to_string();
    let mut first = text.lines().next()?.split(' ');
    let (method, path) = (first.next()?.to_string(), first.next()?.to_string());
    let hit = method == "GET" && path.contains(fault.matching);
    if hit {
        hits.fetch_add(1, Ordering::SeqCst);
        match fault.kind {
            Kind::Reset => {
                reset(conn);
                return Some(());
            }
            Kind::Status(code) => {
                let msg = "<Error><Code>Injected</Code><Message>injected</Message></Error>";
                let _ = write!(
                    conn,
                    "HTTP/1.1 {code} Injected\r\nContent-Length: {}\r\nContent-Type: application/xml\r\nConnection: close\r\n\r\n{msg}",
                    msg.len()
                );
                return Some(());
            }
            Kind::Delay(d) => std::thread::sleep(d),
            Kind::Truncate | Kind::Corrupt | Kind::CorruptFirst => {}
        }
    }
    // Forward with `Connection: close` and read the whole answer.
    let mut up = TcpStream::connect(("127.0.0.1", upstream)).ok()?;
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
    up.write_all(&body).ok()?;
    let (rhead, mut payload) = read_head(&mut up)?;
    up.read_to_end(&mut payload).ok()?;
    let rtext = String::from_utf8_lossy(&rhead).to_string();
    let declared = match header(&rhead, "content-length") {
        Some(v) if method == "HEAD" => v,
        _ => payload.len().to_string(),
    };
    if hit && matches!(fault.kind, Kind::Corrupt) && !payload.is_empty() {
        let mid = payload.len() / 2;
        payload[mid] ^= 0xff;
    }
    if hit && matches!(fault.kind, Kind::CorruptFirst) && !payload.is_empty() {
        payload[0] ^= 0xff;
    }
    if hit && matches!(fault.kind, Kind::Truncate) {
        payload.truncate(payload.len() / 2);
    }
    let mut out = String::new();
    for (i, l) in rtext.trim_end().lines().enumerate() {
        let name = l
            .split_once(':')
            .map(|(k, _)| k.trim().to_ascii_lowercase());
        let drop_it = matches!(
            name.as_deref(),
            Some("connection" | "content-length" | "transfer-encoding")
        );
        if i == 0 || !drop_it {
            out.push_str(l);
            out.push_str("\r\n");
        }
    }
    out.push_str(&format!(
        "Content-Length: {declared}\r\nConnection: close\r\n\r\n"
    ));
    conn.write_all(out.as_bytes()).ok()?;
    conn.write_all(&payload).ok()?;
    Some(())
}

impl FaultProxy {
    fn start(upstream: u16, fault: Fault) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let hits = Arc::new(AtomicU32::new(0));
        let h = Arc::clone(&hits);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let h = Arc::clone(&h);
                std::thread::spawn(move || handle(conn, upstream, fault, &h));
            }
        });
        FaultProxy { port, hits }
    }
}

fn remote(url: &str, endpoint: Option<u16>) -> Arc<Remote> {
    let mut c = RemoteConfig::new(url).unwrap();
    c.timeout = Duration::from_secs(2);
    c.wait = Duration::from_secs(5);
    c.lease_ttl = Duration::from_secs(3);
    let port = endpoint.unwrap_or_else(moto_port);
    c.options
        .push(("aws_endpoint".into(), format!("http://127.0.0.1:{port}")));
    Arc::new(Remote::new(c).unwrap())
}

fn reports(r: &Remote) -> usize {
    r.client()
        .unwrap()
        .list(&r.layout().folder("reports"), 100)
        .unwrap()
        .len()
}

/// The `why` of every report on the remote.
fn report_whys(r: &Remote) -> Vec<String> {
    let client = r.client().unwrap();
    client
        .list(&r.layout().folder("reports"), 100)
        .unwrap()
        .iter()
        .map(|m| {
            let (body, _) = client.get_small(&m.location, 1 << 16).unwrap();
            match tcg_cj::parse_strict(&body).unwrap() {
                Value::Object(o) => o["why"].as_str().unwrap().to_string(),
                other => panic!("a report is an object, not {other:?}"),
            }
        })
        .collect()
}

/// The reference published on a fresh bucket (no proxy); `ensure` from a
/// fresh store through a proxy injecting `fault` must mint locally.
fn ensure_through(fault: Fault, evidence: bool, dir: &Path) -> Arc<Remote> {
    let url = bucket();
    let direct = remote(&url, None);
    let a = Engine::open(dir.join("a"))
        .unwrap()
        .with_remote(direct.clone());
    a.import_artifact(KEY, &reference()).unwrap();
    tcg_remote::ops::push(&a, &direct, &[KEY.to_string()], &mut |_, _| {}).unwrap();

    let proxy = FaultProxy::start(moto_port(), fault);
    let b = Engine::open(dir.join("b"))
        .unwrap()
        .with_remote(remote(&url, Some(proxy.port)));
    let calls = std::cell::Cell::new(0);
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut mint = counting_mint(&calls, &work);
    let got = b
        .ensure(KEY, &dir.join("g"), &request(), &mut mint)
        .unwrap_or_else(|e| panic!("{fault:?}: ensure failed: {e}"));
    assert_eq!(got.outcome, EnsureOutcome::Minted, "{fault:?}");
    assert_eq!(got.resolved.source, Source::Compiled, "{fault:?}");
    assert_eq!(calls.get(), 1, "{fault:?}");
    assert!(dir.join("g/model.pt2").exists(), "{fault:?}");
    assert!(proxy.hits.load(Ordering::SeqCst) >= 1, "{fault:?}");
    assert!(stat(&b, "remote_errors") >= 1, "{fault:?}");
    assert_eq!(stat(&b, "remote_hits"), 0, "{fault:?}");
    let n = usize::from(evidence);
    assert_eq!(stat(&b, "remote_reports"), n as i64, "{fault:?}");
    assert_eq!(reports(&direct), n, "{fault:?}");
    // The local result serves from now on: a local hit, no remote call.
    let before = proxy.hits.load(Ordering::SeqCst);
    let again = b
        .ensure(KEY, &dir.join("g2"), &request(), &mut mint)
        .unwrap();
    assert_eq!(again.outcome, EnsureOutcome::Reused, "{fault:?}");
    assert_eq!(again.resolved.source, Source::Local, "{fault:?}");
    assert_eq!(calls.get(), 1, "{fault:?}");
    assert_eq!(proxy.hits.load(Ordering::SeqCst), before, "{fault:?}");
    direct
}

macro_rules! fault_case {
    ($name:ident, $kind:expr, $matching:expr, $evidence:expr) => {
        #[test]
        fn $name() {
            let d = tempfile::tempdir().unwrap();
            let fault = Fault {
                kind: $kind,
                matching: $matching,
            };
            let _ = ensure_through(fault, $evidence, d.path());
        }
    };
}

fault_case!(
    ensure_chunk_500_mints_locally,
    Kind::Status(500),
    "/chunks/",
    false
);
fault_case!(
    ensure_ref_503_mints_locally,
    Kind::Status(503),
    "/refs/",
    false
);
fault_case!(
    ensure_manifest_403_mints_locally,
    Kind::Status(403),
    "/manifests/",
    false
);
fault_case!(
    ensure_slow_chunk_past_the_timeout_mints_locally,
    Kind::Delay(Duration::from_secs(6)),
    "/chunks/",
    false
);
fault_case!(
    ensure_truncated_chunk_mints_locally,
    Kind::Truncate,
    "/chunks/",
    false
);
fault_case!(
    ensure_reset_mid_chunk_mints_locally,
    Kind::Reset,
    "/chunks/",
    false
);
fault_case!(
    ensure_corrupt_chunk_mints_locally_and_reports,
    Kind::Corrupt,
    "/chunks/",
    true
);
fault_case!(
    ensure_corrupt_manifest_mints_locally_and_reports,
    Kind::Corrupt,
    "/manifests/",
    true
);

/// The stream hands a chunk's bytes on as they arrive and its last frame
/// only once the chunk's SHA-256 matches. When the parser refuses bytes
/// before that, the chunk is read to its end first: the evidence states the
/// proven fault (the chunk's digest), not the parser's view of unchecked
/// bytes.
#[test]
fn bytes_refused_before_their_chunk_is_checked_are_reported_by_the_check() {
    let d = tempfile::tempdir().unwrap();
    let fault = Fault {
        kind: Kind::CorruptFirst,
        matching: "/chunks/",
    };
    let direct = ensure_through(fault, true, d.path());
    let whys = report_whys(&direct);
    assert_eq!(whys.len(), 1, "{whys:?}");
    assert!(whys[0].contains("has SHA-256"), "{whys:?}");
}

/// An unreachable remote (nothing listens): a local mint, never a failure.
#[test]
fn ensure_with_an_unreachable_remote_mints_locally() {
    let d = tempfile::tempdir().unwrap();
    let _ = moto_port();
    let b = Engine::open(d.path().join("b"))
        .unwrap()
        .with_remote(remote("s3://nowhere/p", Some(free_port())));
    let calls = std::cell::Cell::new(0);
    let work = d.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut mint = counting_mint(&calls, &work);
    let got = b
        .ensure(KEY, &d.path().join("g"), &request(), &mut mint)
        .unwrap();
    assert_eq!(got.outcome, EnsureOutcome::Minted);
    assert_eq!(calls.get(), 1);
    assert!(stat(&b, "remote_errors") >= 1);
}

/// `explain` says whether the remote has a ref for the key (fetching
/// nothing); a failing remote reads as unknown with its reason; no remote, null.
#[test]
fn explain_reports_the_remote_presence_of_the_key() {
    let d = tempfile::tempdir().unwrap();
    let url = bucket();
    let direct = remote(&url, None);
    let a = Engine::open(d.path().join("a"))
        .unwrap()
        .with_remote(direct.clone());
    a.import_artifact(KEY, &reference()).unwrap();
    let facts = a.stored_facts(KEY).unwrap().unwrap();
    let state = |e: &Engine| {
        let v = e.explain(&facts, 3).unwrap();
        v.as_object().unwrap()["remote"].clone()
    };
    let b = Engine::open(d.path().join("b"))
        .unwrap()
        .with_remote(direct.clone());
    let absent = state(&b);
    assert_eq!(
        absent.as_object().unwrap()["state"].as_str(),
        Some("absent")
    );

    tcg_remote::ops::push(&a, &direct, &[KEY.to_string()], &mut |_, _| {}).unwrap();
    let present = state(&b);
    let m = present.as_object().unwrap();
    assert_eq!(m["state"].as_str(), Some("present"));
    let local = a.resolve(KEY, &d.path().join("ga")).unwrap().unwrap();
    assert_eq!(m["manifest"].as_str(), Some(local.manifest.as_str()));
    // Nothing was fetched: b still has no record and no remote hit.
    assert!(b
        .store()
        .get_ref(&tcg_core::engine::graph_ref(KEY))
        .unwrap()
        .is_none());
    assert_eq!(stat(&b, "remote_hits"), 0);
    let text = tcg_core::engine::render_explanation(&b.explain(&facts, 3).unwrap());
    assert!(text.contains("on the remote: manifest "), "{text}");

    let proxy = FaultProxy::start(
        moto_port(),
        Fault {
            kind: Kind::Status(503),
            matching: "/refs/",
        },
    );
    let u = Engine::open(d.path().join("u"))
        .unwrap()
        .with_remote(remote(&url, Some(proxy.port)));
    let unknown = state(&u);
    let m = unknown.as_object().unwrap();
    assert_eq!(m["state"].as_str(), Some("unknown"));
    assert!(m["reason"].as_str().is_some_and(|r| !r.is_empty()));

    let none = Engine::open(d.path().join("n")).unwrap();
    assert_eq!(state(&none), Value::Null);
}
