//! The real S3 server of the fleet-tier tests: moto (`moto[server]==5.2.5`,
//! installed into the repository's .venv by `make deps`), one per test
//! binary on a free loopback port, killed when the binary exits. A missing
//! moto_server fails the tests loudly.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tcg_core::engine::{Engine, Request};

/// The moto_server to run: `TCG_MOTO_SERVER` (a machine whose moto lives
/// outside the repository's .venv), the .venv's, then PATH's.
pub fn moto_server() -> PathBuf {
    if let Some(p) = std::env::var_os("TCG_MOTO_SERVER") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/moto_server");
    if p.exists() {
        return p;
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("moto_server"))
            .find(|c| c.is_file())
    });
    on_path.unwrap_or_else(|| {
        panic!(
            "{} is missing: run `make deps` (the test extra installs moto[server]==5.2.5)",
            p.display()
        )
    })
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kill `pid` when this test process exits: a watchdog child that waits for
/// our pid to vanish (bounded to an hour).
fn kill_on_exit(pid: u32) {
    let me = std::process::id();
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "for i in $(seq 1 7200); do kill -0 {me} 2>/dev/null || break; sleep 0.5; done; kill {pid} 2>/dev/null"
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

/// The port of this binary's moto, started on first use. Credentials,
/// plain HTTP and a private verdict cache for `fleet doctor` are set in the
/// environment once, here (the environment is shared by the tests' threads);
/// the endpoint is not (see [`moto_as_default_endpoint`]).
pub fn moto_port() -> u16 {
    // The child is held for the process's life (statics are not dropped);
    // the watchdog of `kill_on_exit` ends it.
    static MOTO: OnceLock<(u16, Mutex<Child>)> = OnceLock::new();
    MOTO.get_or_init(|| {
        let port = free_port();
        let child = Command::new(moto_server())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start moto_server");
        kill_on_exit(child.id());
        let deadline = Instant::now() + Duration::from_secs(90);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "moto_server did not listen");
            std::thread::sleep(Duration::from_millis(100));
        }
        std::env::set_var("AWS_ALLOW_HTTP", "true");
        std::env::set_var("AWS_ACCESS_KEY_ID", "testing");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "testing");
        std::env::set_var("AWS_REGION", "us-east-1");
        let cache = std::env::temp_dir().join(format!(
            "tcg-{}-tests-{}",
            env!("CARGO_CRATE_NAME"),
            std::process::id()
        ));
        std::env::set_var("XDG_CACHE_HOME", &cache);
        (port, Mutex::new(child))
    })
    .0
}

/// [`moto_port`], with `AWS_ENDPOINT` naming it (set once), so that a
/// remote configured by URL alone reaches moto.
pub fn moto_as_default_endpoint() -> u16 {
    static SET: OnceLock<u16> = OnceLock::new();
    *SET.get_or_init(|| {
        let port = moto_port();
        std::env::set_var("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"));
        port
    })
}

/// A fresh bucket on this binary's moto, as `s3://bucket/fleet`.
pub fn bucket() -> String {
    let port = moto_port();
    let name = format!("b-{}", &tcg_remote::layout::random_hex32()[..12]);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "PUT /{name} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    format!("s3://{name}/fleet")
}

/// The request of the reference artifact (CPU, its own toolchain block).
pub fn request() -> Request {
    let md = tcg_core::artifact::read_metadata(&crate::common::reference()).unwrap();
    Request::new("cpu", &md.value()["toolchain"]).unwrap()
}

/// One integer counter of the engine's stats.
pub fn stat(e: &Engine, name: &str) -> i64 {
    match &e.stats().unwrap().as_object().unwrap()[name] {
        tcg_cj::Value::Int(n) => *n,
        v => panic!("{name} is {v:?}"),
    }
}
